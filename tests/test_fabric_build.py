"""The libfabric the binding is built against: the one asked for, and with efa and verbs
(scripts/build_libfabric.sh) their own code runs up to "no device" on every machine."""
import os
import sys

import pytest

import common.fabric as fi
from scripts.doctor import loaded_from
from common.chapter_pair import chapter_path, local_env
from tests.budget import Budget
from tests.one_line_errors import LIMIT, assert_one_line_error

# The first chapter, the queue, many NICs, the C workers, the MoE ranks.
CHAPTERS = [4, 7, 9, 11, 16]


@pytest.mark.skipif(not os.environ.get("LIBFABRIC_PREFIX"), reason="LIBFABRIC_PREFIX not set: "
                    "the binding uses the system's libfabric (pkg-config)")
def test_the_binding_loads_the_libfabric_of_LIBFABRIC_PREFIX():
    prefix = os.path.realpath(os.environ["LIBFABRIC_PREFIX"])
    path = os.path.realpath(loaded_from())
    assert path.startswith(prefix + os.sep), (
        f"the binding loads {path}, not one under LIBFABRIC_PREFIX={prefix}: "
        "run bash scripts/setup.sh")


@pytest.mark.parametrize("chapter", CHAPTERS)  # within LIMIT seconds, or TimeoutExpired
@pytest.mark.parametrize("provider", ["efa", "verbs"])
def test_a_real_provider_without_its_device_is_one_line(provider, chapter):
    if provider not in fi.providers():
        pytest.skip(f"this libfabric has no {provider} provider (Debian's has neither efa nor "
                    "verbs): build one with scripts/build_libfabric.sh")
    if provider in fi.usable():
        pytest.skip(f"{provider} has a device here")
    done = Budget(LIMIT).run([sys.executable, str(chapter_path(chapter)), "-p", provider],
                             env=local_env())
    assert_one_line_error(done, f"provider '{provider}' has no usable device here")

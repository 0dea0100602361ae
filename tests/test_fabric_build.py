"""The libfabric the binding is built against: the one asked for, and with efa and verbs
(scripts/build_libfabric.sh) their own code runs up to "no device" on every machine."""
import os
import subprocess
import sys

import pytest

from common import bench
import common.fabric as fi
from common.chapter_pair import ROOT, chapter_path, local_env
from common.fabric import loaded_from
from tests.support.budget import Budget
from tests.support.one_line_errors import LIMIT, assert_one_line_error

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


@pytest.mark.parametrize("program", [chapter_path(3), ROOT / "scripts" / "tour.py"])
def test_a_LIBFABRIC_PREFIX_the_binding_does_not_load_stops_a_chapter(tmp_path, program):
    """Issue 48: LIBFABRIC_PREFIX set for a chapter or the tour (not for setup.sh) was
    silently ignored, so a reader could believe the EFA installer's libfabric in use when
    the binding loads another. Now one line: which one it loads, and how to rebuild."""
    env = local_env({"LIBFABRIC_PREFIX": str(tmp_path)})
    done = subprocess.run([sys.executable, str(program)], capture_output=True,
                          text=True, env=env, timeout=120)
    assert done.returncode != 0
    line = done.stderr.strip()
    assert "\n" not in line, line
    assert f"LIBFABRIC_PREFIX={tmp_path}" in line and os.path.realpath(loaded_from()) in line, line
    assert f"LIBFABRIC_PREFIX={tmp_path} bash scripts/setup.sh" in line, line


def test_the_LIBFABRIC_PREFIX_the_binding_loads_is_taken():
    lib_dir = os.path.dirname(os.path.realpath(loaded_from()))
    assert fi.loads_from(os.path.dirname(lib_dir))
    assert not fi.loads_from("/nonexistent/prefix")


def test_fabtests_have_their_own_prefix(monkeypatch, tmp_path):
    """FABTESTS_PREFIX, else LIBFABRIC_PREFIX only where it is the binding's libfabric."""
    monkeypatch.setenv("FABTESTS_PREFIX", str(tmp_path))
    monkeypatch.setenv("LIBFABRIC_PREFIX", "/nonexistent/prefix")
    assert bench.tools_prefix() == tmp_path
    monkeypatch.delenv("FABTESTS_PREFIX")
    assert bench.tools_prefix() == ROOT / ".deps" / "libfabric"

import os

import pytest

from common import cli
from tests import fake_info
from tests.shm_regions import Watcher

PROVIDERS = ["shm", "tcp"]

os.environ.setdefault("FI_TCP_IFACE", "lo")  # keep tcp on loopback in this process too
os.environ[cli.STRETCH] = "1"  # the chapters we start wait as long as this busy machine needs


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_dev_shm():
    """After every run of every chapter, no shm region of ours may be left behind
    (other programs' regions, made while the suite runs, are theirs: tests/shm_regions.py)."""
    watcher = Watcher()
    yield
    left = watcher.left()
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.fixture(autouse=True)
def fake_nics(monkeypatch):
    """FAKE_NICS=1: efa and verbs look present to the choosing code (tests/fake_info.py)."""
    if fake_info.FAKE_NICS:
        fake_info.pretend(monkeypatch, present=("efa", "verbs"))


@pytest.fixture(params=PROVIDERS)
def provider(request):
    return request.param

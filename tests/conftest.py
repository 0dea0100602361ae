import os
import re
from pathlib import Path

import pytest

PROVIDERS = ["shm", "tcp"]
SHM = Path("/dev/shm")
# Names the shm provider gives its regions and sockets: "<pid>:<ep>:<n>".
SHM_NAME = re.compile(r"^\d+:\d+:\d+")

os.environ.setdefault("FI_TCP_IFACE", "lo")  # keep tcp on loopback in this process too


def shm_files():
    return {p.name for p in SHM.iterdir() if SHM_NAME.match(p.name)} if SHM.is_dir() else set()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_in_dev_shm():
    """After every run of every chapter, no shm region of ours may be left behind."""
    before = shm_files()
    yield
    left = shm_files() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.fixture(params=PROVIDERS)
def provider(request):
    return request.param

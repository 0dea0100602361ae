"""The suite's two tiers, and what every test is checked for when it ends.

`pytest` runs the fast tier: every chapter end to end once, every module's unit tests, one
fault of each kind. `pytest -m long` runs the long tier: every fault in every chapter,
loads, every flag and provider combination. A test named by its node id runs whatever
its tier; `-m` chooses otherwise (`-m "long or not long"`: both tiers)."""
import os
import signal
import threading

import pytest

from common import cli
from common.chapter_pair import INTERRUPTED_WAIT
from tests.support import fake_info, processes
from tests.support.budget import Budget
from tests.support.shm_regions import SHM, Watcher

PROVIDERS = ["shm", pytest.param("tcp", marks=pytest.mark.long)]  # tcp in the fast tier: 04
EXIT = 15  # seconds, quiet machine, for what a test started to end after it (a launcher's
#            ranks told through the rendezvous that it is gone stop within their own bound)

os.environ.setdefault("FI_TCP_IFACE", "lo")  # keep tcp on loopback in this process too
os.environ[cli.STRETCH] = "1"  # the chapters we start wait as long as this busy machine needs
STOPPING = []  # the thread that ends what the suite started, once Ctrl-C came


def pytest_collection_modifyitems(config, items):
    """Without -m, and unless tests are named by node id, the long tier is left out."""
    if config.option.markexpr or any("::" in arg for arg in config.args):
        return
    fast, long = [], []
    for item in items:
        (long if item.get_closest_marker("long") else fast).append(item)
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = fast


@pytest.fixture(scope="session", autouse=True)
def watcher():
    """After every run of every chapter, no shm region of ours may be left behind
    (other programs' regions, made while the suite runs, are theirs: tests/support/shm_regions.py),
    and no process the suite started may still run. What is found is removed, then named.
    Ctrl-C ends them all within 2 s (interrupted)."""
    watcher = Watcher()
    before = signal.signal(signal.SIGINT, lambda *_: interrupted(watcher.token))
    yield watcher
    signal.signal(signal.SIGINT, before)
    left = processes.wait_gone(watcher.token, Budget(EXIT).seconds)
    processes.stop(watcher.token, left)
    regions = watcher.left()
    for name in regions:
        (SHM / name).unlink(missing_ok=True)
    assert not left, f"still running after the suite: {processes.report(left)}"
    assert not regions, f"left in /dev/shm: {sorted(regions)}"


def interrupted(token):
    """Ctrl-C to pytest: Ctrl-C now to every process the suite started (a test waiting on
    one, or its clean-up, would otherwise wait out the chapter's --timeout, and the
    fixtures below their EXIT), a kill to those still running INTERRUPTED_WAIT s later;
    then the KeyboardInterrupt, as Python's own handler raises it."""
    if not STOPPING:
        fds = processes.signalled(token, processes.running(token), signal.SIGINT)
        STOPPING.append(threading.Thread(target=processes.finish, args=(fds, INTERRUPTED_WAIT),
                                         daemon=True))
        STOPPING[0].start()
    raise KeyboardInterrupt


def pytest_keyboard_interrupt(excinfo):
    """pytest ends only once what the suite started has (the thread of interrupted())."""
    for thread in STOPPING:
        thread.join()


@pytest.fixture(autouse=True)
def nothing_left_running(watcher):
    """Each test's processes end with it (or within EXIT seconds), and what they made in
    /dev/shm with them: the test that left either is the one that fails, and the process
    is stopped, the region removed."""
    yield
    left = processes.wait_gone(watcher.token, Budget(EXIT).seconds)
    processes.stop(watcher.token, left)
    orphans = watcher.orphans()
    assert not left, f"still running after the test: {processes.report(left)}"
    assert not orphans, f"left in /dev/shm by its ended processes: {sorted(orphans)}"


@pytest.fixture(autouse=True)
def fake_nics(monkeypatch):
    """FAKE_NICS=1: efa and verbs look present to the choosing code (tests/support/fake_info.py)."""
    if fake_info.FAKE_NICS:
        fake_info.pretend(monkeypatch, present=("efa", "verbs"))


@pytest.fixture(params=PROVIDERS)
def provider(request):
    return request.param

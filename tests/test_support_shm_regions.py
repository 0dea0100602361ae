"""The leak check counts the regions our processes leave, not those of other programs."""
import os
import subprocess
import sys
import time

import pytest

from common import shm_files
from tests.support.shm_regions import SHM, Watcher

# Makes a region named like shm's after itself, says its name, and leaves it behind once
# its stdin closes.
LEAVE = ("import os, sys; name = f'{os.getpid()}:0:4242'; open('/dev/shm/' + name, 'w').close();"
         "print(name, flush=True); sys.stdin.read()")


def test_only_our_processes_regions_are_leaks():
    watcher = Watcher("SHM_REGIONS_SELFTEST")
    if watcher.thread is None:
        del os.environ["SHM_REGIONS_SELFTEST"]
        pytest.skip("no inotify here: only creators alive at the end are told apart")
    foreign_env = {k: v for k, v in os.environ.items() if k != "SHM_REGIONS_SELFTEST"}
    children = [subprocess.Popen([sys.executable, "-c", LEAVE], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for env in (os.environ, foreign_env)]
    names = [c.stdout.readline().strip() for c in children]
    try:
        deadline = time.monotonic() + 60  # the watcher looks at both while they live
        while not set(names) <= watcher.seen and time.monotonic() < deadline:
            time.sleep(0.05)
        for c in children:
            c.stdin.close()
            c.wait()
        assert watcher.left() == {names[0]}, (names, watcher.foreign)
    finally:
        del os.environ["SHM_REGIONS_SELFTEST"]
        for name in names:
            (SHM / name).unlink(missing_ok=True)


def test_a_stopped_watcher_reads_nothing_more():
    """Once left() has answered, the thread is gone: a file that gets the inotify fd's number
    next (here a pipe) keeps every byte. (A thread left blocked in read on a closed fd once
    took a byte of a chapter's stdout in the suite.)"""
    watcher = Watcher("SHM_REGIONS_SELFTEST")
    del os.environ["SHM_REGIONS_SELFTEST"]
    watcher.left()
    read, write = os.pipe()
    region = SHM / f"{os.getpid()}:0:4343"
    try:
        region.touch()  # an event: a thread still reading would now read the fd's new file
        time.sleep(0.2)
        os.write(write, b"every byte")
        time.sleep(0.2)  # room for a stray reader to take some
        assert os.read(read, 64) == b"every byte"
    finally:
        region.unlink(missing_ok=True)
        os.close(read)
        os.close(write)


def test_a_process_reaped_while_its_state_is_read_has_ended(monkeypatch):
    """/proc/PID/stat opened, then the process reaped: the read raises ESRCH. That is an end
    (it raised out of a finished rank of 16, in a suite run), not an error."""
    class Reaped:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read(self):
            raise ProcessLookupError(3, "No such process")
    monkeypatch.setattr("builtins.open", lambda *a, **k: Reaped())
    assert shm_files.ended(12345)

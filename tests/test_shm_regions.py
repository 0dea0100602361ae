"""The leak check counts the regions our processes leave, not those of other programs."""
import os
import subprocess
import sys
import time

import pytest

from tests.shm_regions import SHM, Watcher

# Makes a region named like shm's after itself, says its name, and leaves it behind once
# its stdin closes.
LEAVE = ("import os, sys; name = f'{os.getpid()}:0:4242'; open('/dev/shm/' + name, 'w').close();"
         "print(name, flush=True); sys.stdin.read()")


def test_only_our_processes_regions_are_leaks():
    watcher = Watcher("SHM_REGIONS_SELFTEST")
    if watcher.fd < 0:
        del os.environ["SHM_REGIONS_SELFTEST"]
        pytest.skip("no inotify here: only creators alive at the end are told apart")
    foreign_env = {k: v for k, v in os.environ.items() if k != "SHM_REGIONS_SELFTEST"}
    children = [subprocess.Popen([sys.executable, "-c", LEAVE], env=env, text=True,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for env in (os.environ, foreign_env)]
    names = [c.stdout.readline().strip() for c in children]
    try:
        deadline = time.monotonic() + 60  # the watcher sees the foreign one while it lives
        while names[1] not in watcher.foreign and time.monotonic() < deadline:
            time.sleep(0.05)
        for c in children:
            c.stdin.close()
            c.wait()
        assert watcher.left() == {names[0]}
    finally:
        del os.environ["SHM_REGIONS_SELFTEST"]
        for name in names:
            (SHM / name).unlink(missing_ok=True)

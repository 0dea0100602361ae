"""The processes the suite started that are still running: those whose environment carries
its token (tests/support/shm_regions.py puts it there; every child inherits it).

A process named here is stopped through a pidfd opened before its environment is read
again, so that a pid reused by someone else's process in between is never signalled.
"""
import os
import select
import signal
import time
from pathlib import Path

from common import shm_files

PROC = Path("/proc")
KILLED = 1.0  # seconds a SIGKILLed process may take to be gone (its memory freed)


def running(token):
    """{pid: command line} of the live processes whose environment holds `token`, except
    this one (pytest). A zombie's environment reads empty: it is not running."""
    found = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if token in (entry / "environ").read_bytes().split(b"\0"):
                found[int(entry.name)] = command(entry)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def alive(pid):
    return not shm_files.ended(pid)


def kill_job(launcher, pids):
    """End a launcher (or pair.py) and what it started, whatever state a test left them in
    (one frozen, say): none may outlive the test."""
    launcher.kill()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def command(entry):
    return (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def ctrl_c(proc, whom, budget):
    """Ctrl-C to a job started in a session of its own: as a terminal sends it (`whom`
    "group": its whole process group) or to `proc` alone. Returns its (out, err) and the
    seconds from the signal to its end."""
    signalled = time.monotonic()
    if whom == "group":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        proc.send_signal(signal.SIGINT)
    out, err = budget.communicate(proc)
    return out, err, time.monotonic() - signalled


def wait_gone(token, seconds):
    """What is still running after `seconds`: processes given time to end by themselves
    (a launcher's ranks stop within their bound after it is gone)."""
    deadline = time.monotonic() + seconds
    left = running(token)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = running(token)
    return left


def stop(token, pids, seconds=5.0, first=signal.SIGTERM):
    """`first` (SIGTERM), then SIGKILL after `seconds`, to each of `pids` that still holds
    `token`; what those killed left in /dev/shm is removed."""
    finish(signalled(token, pids, first), seconds)


def signalled(token, pids, sig):
    """Send `sig` to each of `pids` that still holds `token`: their pidfds, for finish()."""
    fds = []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # already gone
            continue
        try:  # the pidfd pins this very process: is it still one of ours?
            ours = token in (PROC / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            ours = False
        if ours:
            send(fd, sig)
            fds.append((pid, fd))
        else:
            os.close(fd)
    return fds


def finish(fds, seconds):
    """SIGKILL to the processes of `fds` (signalled()) still running `seconds` from now, and
    what they left in /dev/shm removed once they are gone."""
    deadline, killed = time.monotonic() + seconds, []
    for pid, fd in fds:  # a pidfd reads ready once its process has ended
        if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            send(fd, signal.SIGKILL)
            killed.append((pid, fd))
    for pid, fd in killed:
        select.select([fd], [], [], KILLED)
    shm_files.remove_left_by([pid for pid, _ in killed])
    for _, fd in fds:
        os.close(fd)


def send(fd, sig):
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:  # it ended (and was reaped) meanwhile
        pass


def report(left):
    return "; ".join(f"pid {pid}: {cmd}" for pid, cmd in sorted(left.items()))

"""The processes of a fault trial (scripts/chaos.py): each started in a process group of its
own, its streams collected; the watch on what carries the trial's token; what it leaves.

A trial's processes are in groups of their own inside our session, not in sessions of
their own: a group whose members have no parent in another group of the same session is
orphaned, and the kernel discards a SIGTSTP sent to it (kernel/signal.c, get_signal:
is_current_pgrp_orphaned), so Ctrl-Z could not stop it. Ours, like a shell's jobs, is
not. Their stdin is /dev/null: a process outside the terminal's foreground group that
reads the terminal is stopped.
"""
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from common.chapter_pair import ROOT
from common.patience import patience

TOKEN = "CHAOS_TRIAL"
SHM = Path("/dev/shm")
PIDS = re.compile(r"^launch: .*; pids ([\d ]+)$", re.MULTILINE)
SIGNALLED = 2.0  # seconds a signalled process may take to end


class Proc:
    """One process of a trial: started in a process group of its own, both streams collected."""

    def __init__(self, name, args, env):
        self.name, self.args = name, args
        self.popen = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                      preexec_fn=os.setpgrp)  # process_group=0 from 3.11
        self.pid, self.started, self.ended = self.popen.pid, time.monotonic(), None
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(s, lines), daemon=True)
                        for s, lines in ((self.popen.stdout, self.out),
                                         (self.popen.stderr, self.err))]
        for r in self.readers:
            r.start()

    @staticmethod
    def _read(stream, lines):
        for line in stream:
            lines.append(line)

    def alive(self):
        if self.popen.poll() is None:
            return True
        self.ended = self.ended or time.monotonic()
        return False

    @property
    def rc(self):
        return self.popen.returncode

    def exit_code(self):
        """How it ended: its exit code, or minus the signal that killed it."""
        return self.rc

    def wait(self, seconds):
        """Whether it ended within `seconds`; if so, with what it wrote read to the end (its
        last line can still be in the pipe when the exit is seen)."""
        deadline = time.monotonic() + seconds
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive():
            return False
        for r in self.readers:
            r.join(1)
        return True

    def kill(self):
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait()
        self.alive()
        for r in self.readers:
            r.join(1)

    def own_err(self):
        """What it wrote to stderr itself."""
        return self.err

    def stderr_lines(self):
        return [line for line in self.own_err() if line.strip()]


class Launcher(Proc):
    """scripts/launch.py: its own lines are those not prefixed by a rank, less the first
    (which ranks it started)."""

    def own_err(self):
        return [line for line in self.err if not re.match(r"\[\d+\] ", line)
                and not PIDS.match(line)]


class Rank:
    """A rank under the launcher: not our child, so seen through /proc; its lines are the
    launcher's, prefixed "[rank] "."""

    def __init__(self, rank, pid, launcher):
        self.name, self.pid, self.launcher, self.ended = f"rank {rank}", pid, launcher, None
        self.prefix = f"[{rank}] "

    def alive(self):
        try:
            state = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            self.ended = self.ended or time.monotonic()
            return False
        return True

    def wait(self, seconds):
        """Whether it ended within `seconds`; if so, with its last line read: that comes
        through the launcher, which may not have passed it on yet when the rank is gone."""
        deadline = time.monotonic() + seconds
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive():
            return False
        wait_for(lambda: self.stderr_lines() or not self.launcher.alive(), patience(SIGNALLED))
        if not self.launcher.alive():
            self.launcher.wait(0)  # read to the end
        return True

    rc = None  # its exit code is the launcher's to read

    def exit_code(self):
        """How it ended, where the launcher's last line tells (it names the rank that ended
        the job: "launch: rank 2 was killed by SIGTERM; ..."); else None."""
        rank = self.prefix[1:-2]
        for line in self.launcher.err:
            if m := re.match(rf"launch: rank {rank} (was killed by (SIG\w+)|exited with code "
                             r"(\d+))", line):
                return -signal.Signals[m[2]] if m[2] else int(m[3])
        return None

    @property
    def err(self):
        n = len(self.prefix)
        return [line[n:] for line in self.launcher.err if line.startswith(self.prefix)]

    def own_err(self):
        return self.err

    def stderr_lines(self):
        return [line for line in self.err if line.strip()]

    def kill(self):
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def carriers(token):
    """Pids of the processes whose environment carries the trial's token."""
    mark, found = f"{TOKEN}={token}".encode(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def shm_files(pids):
    """The /dev/shm files that `pids` have mapped (the MoE and weights chapters' files are
    named moe-<job>-<name>, so one of a job's tells its others' names)."""
    names = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        names.update(m[1] for m in re.finditer(r" /dev/shm/(\S+)", maps))
    return names


class Watch(threading.Thread):
    """Every 50 ms: which processes carry the token, which /dev/shm files they have mapped."""

    def __init__(self, token):
        super().__init__(daemon=True)
        self.token, self.pids, self.files, self.stopping = token, set(), set(), False
        self.start()

    def run(self):
        while not self.stopping:
            self.look()
            time.sleep(0.05)

    def look(self):
        now = carriers(self.token)
        self.pids.update(now)
        self.files.update(shm_files(now))

    def stop(self):
        self.stopping = True
        self.join()
        self.look()


@contextlib.contextmanager
def signals_held():
    """Ctrl-C and SIGTERM wait for the block's end, then act as they would have. The block
    that kills a trial's processes must kill them all: in groups of their own, they do not
    get the terminal's Ctrl-C. Main thread only (Python's handlers run there)."""
    got = []
    kept = {s: signal.signal(s, lambda signum, _frame: got.append(signum))
            for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)
        if got:
            signal.raise_signal(got[0])

def leftovers(pids, files):
    """The /dev/shm files that the trial's processes left: the shm provider's regions
    "<pid>:<uid>:<n>" (prov/shm/src/smr_ep.c, smr_endpoint_name), and what they mapped.
    A chapter of the trial that started 10 s after one was left, with nothing mapping it,
    has removed it already (common/shm_files.py, sweep) and said so on its stdout."""
    if not SHM.is_dir():
        return []
    jobs = {m[1] for m in (re.match(r"moe-([0-9a-f]+)-", f) for f in files) if m}
    return sorted(p.name for p in SHM.iterdir()
                  if p.name in files or p.name.split(":")[0] in {str(p) for p in pids}
                  or any(p.name.startswith(f"moe-{j}-") for j in jobs))


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()



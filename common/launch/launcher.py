"""The launcher: W ranks of a program as children of this process, each line they print
prefixed with its rank, all stopped within a bound once one fails or a signal comes."""
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from common import shm_files
from common.launch.rendezvous import ALIVE_EVERY, RendezvousServer


MAX_RANKS = 128   # 16 emulated p5 nodes of 8 GPUs; each rank is a Python process of its own
KILL_WAIT = 5.0   # seconds between SIGTERM and SIGKILL for a rank that does not stop
JOIN_WAIT = 1.0   # seconds for a rank the rendezvous lost to end, when others ended first
PF_EXITING = 0x4  # include/linux/sched.h: the task is exiting
STOPS = {signal.SIGINT: "was interrupted (Ctrl-C)", signal.SIGTERM: "got SIGTERM",
         signal.SIGHUP: "got SIGHUP (its terminal closed)"}
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
SIG_DFL = 0  # <signal.h>: a signal's default action


def owned(args, **popen):
    """subprocess.Popen for a child that this process alone owns and signals.

    - It gets SIGTERM when we die, of SIGKILL too (prctl PR_SET_PDEATHSIG), and so closes
      what it opened (its /dev/shm files, which nobody would remove after us). The kernel
      sends it when the *thread* that forked the child ends: call this from the main thread.
    - It is in a process group of its own: a terminal's Ctrl-C reaches us alone and we pass
      one signal on. Two (the terminal's and ours, right behind) could cut its clean-up
      short: a KeyboardInterrupt as a `with` block begins to unwind closes nothing.
    - Its stdin is /dev/null: a process outside the terminal's group that reads it is
      stopped.
    """
    parent = os.getpid()
    libc = ctypes.CDLL(None)

    def in_child():  # between fork and exec: nothing that takes a lock another thread holds
        os.setpgid(0, 0)  # (Popen's process_group=0, from Python 3.11)
        # Until exec this is a copy of us, whose SIGTERM handler only notes the signal in
        # memory that exec discards: a death of ours in that instant would go unheard
        libc.signal(signal.SIGTERM, SIG_DFL)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0 or os.getppid() != parent:
            os._exit(1)  # no prctl, or we died before it was set: nobody to run for
    return subprocess.Popen(args, preexec_fn=in_child, stdin=subprocess.DEVNULL, **popen)


class Signals:
    """SIGINT, SIGTERM and SIGHUP as news for a loop to act on, never an exception that cuts
    into its clean-up. A context manager; from the main thread (signal.signal's rule)."""

    def __init__(self):
        self.got = []  # the signals received, in order

    def __enter__(self):
        self.before = {s: signal.signal(s, lambda signum, _: self.got.append(signum))
                       for s in STOPS}
        return self

    def __exit__(self, *_):
        for s, handler in self.before.items():
            signal.signal(s, handler)


def spawn(argv, world, ranks_per_node=None, gpus=None, grace=10.0, out=sys.stdout,
          err=sys.stderr):
    """Run `argv` (a Python program and its arguments) as `world` ranks on this host.

    Each line a rank prints comes out prefixed with its rank. When a rank fails
    (non-zero exit, or killed), the others are told through the rendezvous and
    get `grace` seconds to stop by themselves, then SIGTERM, then SIGKILL after
    KILL_WAIT more. SIGINT, SIGTERM or SIGHUP here is passed on to every rank,
    once; a second one kills them at once. A rank frozen (SIGSTOPped) fails the
    job once it was silent for its --timeout (the rendezvous's silence). So the
    launcher ends within grace + KILL_WAIT seconds of a failure or a signal, a
    frozen rank included, and its ranks with it whatever ends it (owned). What a
    killed rank left in /dev/shm is removed. Returns the exit code: 0 when every
    rank succeeded, else the first failure's (128 + the signal's number for ours).
    """
    per_node = ranks_per_node or world
    with Signals() as signals:  # from the first step to the last line: ours, not Python's
        server = RendezvousServer(world, per_node)
        host, port = server.address
        job = Job(server, grace)
        for rank in range(world):
            if signals.got:  # no more ranks: stop those that are there
                break
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node),
                       RENDEZVOUS=f"{host}:{port}", PYTHONUNBUFFERED="1")
            if gpus:
                env["RANK_GPU"] = str(gpus[rank % len(gpus)])
            job.procs.append(owned([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True))
            server.alive(rank)
        readers = [_prefixed(stream, f"[{rank}] ", sink) for rank, p in enumerate(job.procs)
                   for stream, sink in ((p.stdout, out), (p.stderr, err))]
        print(f"launch: {world} ranks, {per_node} per node ({world // per_node} node"
              f"{'s' * (world > per_node)}); pids {' '.join(str(p.pid) for p in job.procs)}",
              file=err, flush=True)
        while job.running():
            job.step(signals.got)
            time.sleep(0.02)
        for r in readers:
            r.join(1.0)  # the ranks are gone: what they wrote is read at once
        killed = [p.pid for p in job.procs if p.returncode < 0]
        shm_files.remove_left_by(killed, server.job)
        job.step(signals.got)  # a signal that came as the ranks ended is said too
        return job.report(world, err)


class Job:
    """The ranks of one spawn, and the steps of stopping them: each step's time is set when
    stopping begins, so a loop that calls step() ends within grace + KILL_WAIT."""

    def __init__(self, server, grace):
        self.server, self.grace = server, grace
        self.procs = []
        self.first = None      # (rank or None, exit code) of what ended the job
        self.since = None      # when stopping began
        self.term_at = self.kill_at = None  # when the ranks get SIGTERM, and SIGKILL
        self.passed_on = 0     # how many of our signals were seen
        self.next_look = 0.0   # when to look at the processes of the ranks not joined yet

    def running(self):
        return any(p.poll() is None for p in self.procs)

    def step(self, got):
        now = time.monotonic()
        if len(got) > self.passed_on:
            self._signalled(got[0], now)
            self.passed_on = len(got)
        if now >= self.next_look:
            self._look(now)
        if self.first is None:  # a rank's end names the cause better than the rendezvous,
            # but for a frozen rank: the others' ends only follow the rendezvous's word
            self.first = (None, 1) if self.server.silent is not None else self.failed()
        if (self.first or self.server.failure) and self.since is None:
            self._stopping(now)
        if self.term_at is not None and now >= self.term_at:
            self._send(signal.SIGTERM)
            self.term_at = None
            if self.kill_at is None:
                self.kill_at = now + KILL_WAIT
        if self.kill_at is not None and now >= self.kill_at:
            self._send(signal.SIGKILL)

    def _look(self, now):
        """A rank that has not joined yet cannot say it lives: its process running (not
        stopped) says it for it."""
        self.next_look = now + ALIVE_EVERY
        waiting = self.server.waiting_for()
        for rank, p in enumerate(self.procs):
            if rank in waiting and p.poll() is None and runs(p.pid):
                self.server.alive(rank)

    def _stopping(self, now):
        self.since, self.term_at = now, now + self.grace

    def _signalled(self, signum, now):
        """Our first signal goes on to every rank, once (the rendezvous is not told: its
        ABORT landing in a rank's clean-up would cut it short too); a second kills."""
        if self.passed_on:
            self.kill_at = now
            return
        self._send(signum)
        if self.first is None:
            self.first = (None, 128 + signum)
            self._stopping(now)

    def _send(self, signum):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)
                if signum != signal.SIGKILL:
                    p.send_signal(signal.SIGCONT)  # a stopped rank acts on it only then

    def failed(self):
        """The rank that failed, preferring one killed by a signal, then the one the
        rendezvous lost first: the others that exit with an error only followed it. (The
        rendezvous reads the closes of one moment in any order: a survivor that tcp told
        of a SIGKILLed peer at once can close first.) A killed rank's sockets close after
        its memory is freed but before it is reaped: so once one rank ended, the rank the
        rendezvous lost and any rank still exiting get JOIN_WAIT to end."""
        gone = self.server.gone
        if any(p.poll() not in (None, 0) for p in self.procs):
            until = time.monotonic() + JOIN_WAIT
            for r, p in enumerate(self.procs):
                if r == gone or (p.poll() is None and exiting(p.pid)):
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(max(0.0, until - time.monotonic()))
        dead = [(rank, p.returncode) for rank, p in enumerate(self.procs)
                if p.poll() not in (None, 0)]
        dead.sort(key=lambda d: (d[1] > 0, d[0] != gone))
        if dead:
            self.server.abort(f"rank {dead[0][0]} {_how(dead[0][1])}")
        return dead[0] if dead else None

    def report(self, world, err):
        first = self.first or self.failed() or ((None, 1) if self.server.failure else None)
        if first is None:
            return 0
        rank, rc = first
        elapsed = time.monotonic() - self.since if self.since else 0.0
        what = (f"rank {rank} {_how(rc)}" if rank is not None else
                f"the launcher {STOPS[rc - 128]}" if rc > 128 else self.server.failure)
        stopped = f"all {len(self.procs)} ranks stopped" if len(self.procs) == world else \
            f"the {len(self.procs)} of {world} ranks started stopped"
        print(f"launch: {what}; {stopped} {elapsed:.1f} s later", file=err, flush=True)
        return rc if rc > 0 else 1


def runs(pid):
    """Whether process `pid` runs: not stopped (SIGSTOP, a debugger) nor a zombie, by its
    state in /proc (proc(5)); where there is no /proc, taken as running."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("T", "t", "Z", "X")


def exiting(pid):
    """Whether process `pid` is on its way out (PF_EXITING in the flags of /proc/<pid>/stat,
    proc(5)): killed or exiting, not yet a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return bool(int(stat.read().rsplit(")", 1)[1].split()[6]) & PF_EXITING)
    except (OSError, IndexError, ValueError):
        return False


def _how(rc):
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def _prefixed(stream, prefix, sink):
    def copy():
        for line in stream:
            sink.write(prefix + line)
            sink.flush()
    t = threading.Thread(target=copy, daemon=True)
    t.start()
    return t

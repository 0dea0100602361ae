"""The faults of a trial (scripts/chaos.py): how each is dealt to its victim, and the bounds
that the victim and its survivors are held to.

- SIGINT, SIGTERM: the victim ends within 2 s with 130 or 143 and one line on stderr.
- SIGKILL: it is gone at once; the survivors are held to their bounds.
- SIGSTOP: a frozen peer, kept stopped until the end of the trial.
- STOPCONT: SIGSTOP, then SIGCONT after a pause from 0.1 s to past the peer's --timeout
  (a debugger's break, a VM paused); TSTP: the same by SIGTSTP to its process group,
  which is Ctrl-Z at a terminal (the chapters keep its default action: stop), then fg.
  The continued side ends with one line and a non-zero exit, or finishes, exit 0 and
  no wrong byte; a server continued serves its next client.
- EXIT: the client (the ranks) ends on its own early: its --timeout is 0 (a wait that
  finds nothing at its first look gives up) up to a fraction of a second, so it gives up
  at whichever wait of its life first finds its peer slower than that.
- LIE: the client is scripts/fuzz_connect.py, which sends the server one lie in the
  chapter's own formats (a CONNECT or a control message that is wrong) and exits 0; the
  server says one line about it and serves its next client.

A survivor ends, or serves its next client, within its --timeout + 5 s of its peer's fault:
of the stop, where the pause outlasted its --timeout, else of the end the continued run
can have come to (the rest of its life after the pause). A fault is one Fault object;
one whose client is another program (a client that lies) overrides client().
"""
import os
import re
import signal
import sys
import time

from common.chapter_pair import ROOT
from common.chaos.procs import SIGNALLED, Proc, wait_for
from common.patience import patience

WRONG = re.compile(r"\b[1-9]\d* wrong bytes")
# CPython's start prints this when a KeyboardInterrupt cuts into its look at argv[0] (is it
# a zip to import from?), and runs the program on: the Ctrl-C is lost before any code of ours
PYTHON_RAN_ON = "Failed checking if argv[0] is an import path entry"
# ... and this when one lands in a callback of its own import system (a module lock's,
# collected), which it may not raise from: "Exception ignored", and the program runs on
PYTHON_IGNORED = re.compile(r'Exception ignored in: .*\nTraceback \(most recent call last\):\n'
                            r'(  File "<frozen [^"]+".*\n)+KeyboardInterrupt')
PAST = 1.5          # a pause: from 0.1 s to this many --timeouts of the peer, well past it
OWN_TIMEOUT = 0.5   # EXIT's --timeout: 0 or up to this many seconds
AFTER_MAIN = 0.1    # seconds: a victim that exits 0 this soon after the signal had finished


class Fault:
    """A signal sent at the trial's instant, the victim then held to the signalled bounds."""
    lethal = True      # the victim cannot finish its work (so its launcher cannot succeed)
    own_end = False    # the victim ends by itself, at no instant of ours
    victims = ("server", "client", "rank", "launcher")

    def __init__(self, name, signum=None):
        self.name, self.signum = name, signum

    chapters = None    # the chapters it applies to, where not all

    def client(self, trial, args, address):
        """The victim's command (a client's, or each rank's), from the trial's own."""
        return args

    def deal(self, run, victim, trial, origin, timeout):
        """Wait for the trial's instant and deal the fault; the time from which the
        survivors' bounds count, or None when the victim had ended before (a miss)."""
        if not reach(victim, trial, origin):
            return None
        os.kill(victim.pid, self.signum)
        if self.signum == signal.SIGKILL and isinstance(victim, Proc):  # a rank's: the launcher's
            run.killed.add(victim.pid)
        return time.monotonic()

    def judge(self, run, victim, since, bound):
        """The bounds of the victim."""
        if self.signum == signal.SIGKILL:
            if not victim.wait(patience(SIGNALLED)):
                run.problem(victim, "still alive after SIGKILL")
            return
        signalled_ok(run, victim, self.name, self.signum, since)

    def late(self, grace):
        """How much later than the others a launcher may end when one of its ranks got this:
        a stopped rank ends only when the launcher kills it, its grace, then SIGTERM, 5 s
        later SIGKILL (common/launch/launcher.py spawn, Job._send)."""
        return 0.0


class Freeze(Fault):
    """SIGSTOP, kept: the victim is killed with the trial."""

    def judge(self, run, victim, since, bound):
        pass

    def late(self, grace):
        return grace + 5


class StopCont(Freeze):
    """Stopped by `signum` (SIGSTOP, or Ctrl-Z's SIGTSTP to its process group), continued
    (fg: SIGCONT to the group) after a pause drawn from the trial's `extra`."""
    lethal = False

    def deal(self, run, victim, trial, origin, timeout):
        if not reach(victim, trial, origin):
            return None
        os.killpg(victim.pid, self.signum)
        stopped = time.monotonic()
        pause = 0.1 + trial.extra * PAST * timeout
        trial.detail = f"continued after {pause:.2f} s"
        time.sleep(pause)
        try:
            os.killpg(victim.pid, signal.SIGCONT)
        except ProcessLookupError:  # a rank the launcher killed meanwhile
            pass
        # the continued side can only see what became of its peer now; a pause within the
        # peer's --timeout (and the load's delays) leaves the peer waiting on, and the run
        # goes on, to its end at the latest; after a longer one the peer had a frozen one
        run.continued = time.monotonic() + trial.life
        return run.continued if pause < timeout + 1 else stopped

    def judge(self, run, victim, since, bound):
        survivor_ok(run, victim, bound, run.continued, "after its continue")


class OwnEnd(Fault):
    """The client (each rank) ends by itself: a --timeout from 0 to OWN_TIMEOUT."""
    lethal, own_end = False, True
    victims = ("client", "rank")

    def timeout(self, trial):
        return 0.0 if trial.extra < 0.2 else OWN_TIMEOUT * (trial.extra - 0.2) / 0.8

    def client(self, trial, args, address):
        trial.detail = f"--timeout {self.timeout(trial):.3f}"
        return [*args, "--timeout", f"{self.timeout(trial):.3f}"]  # the last one counts

    def deal(self, run, victim, trial, origin, timeout):
        bound = patience(trial.life) + timeout + 5
        if not victim.wait(max(0.0, origin + bound - time.monotonic())):
            run.problem(victim, f"still running {bound:.1f} s into a run with a short "
                        "--timeout")
            return None
        return victim.ended

    def judge(self, run, victim, since, bound):
        survivor_ok(run, victim, 0.0, since, "by itself")


class Lie(OwnEnd):
    """A client that lies: lie K of the trial's number as seed (drawn from the trial's
    `pick`), at the chapters whose servers read a CONNECT (common/chaos/lies.py CHAPTERS)."""
    victims = ("client",)
    chapters = ("05", "06", "07", "09", "10", "11", "12", "13", "14", "15", "18")
    LIES = 1000  # K from 1 to this: every kind of lie, each with its own draws

    def client(self, trial, args, address):
        lie = trial.pick % self.LIES + 1
        trial.detail = f"lie {lie} of seed {trial.number}"
        return [sys.executable, str(ROOT / "scripts" / "fuzz_connect.py"), "--address", address,
                "--chapter", trial.chapter, "-p", trial.provider, "--seed", str(trial.number),
                "--lie", str(lie)]


FAULTS = {f.name: f for f in (
    Fault("SIGINT", signal.SIGINT), Fault("SIGTERM", signal.SIGTERM),
    Fault("SIGKILL", signal.SIGKILL), Freeze("SIGSTOP", signal.SIGSTOP),
    StopCont("STOPCONT", signal.SIGSTOP), StopCont("TSTP", signal.SIGTSTP), OwnEnd("EXIT"),
    Lie("LIE"))}


def reach(victim, trial, origin):
    """Wait for the trial's instant (`origin` + its moment); whether the victim still runs
    then (a victim that had ended is a miss)."""
    wait_for(lambda: not victim.alive(), max(0.0, origin + trial.moment - time.monotonic()))
    if victim.alive():
        return True
    trial.missed = True
    return False


def signalled_ok(run, proc, name, signum, since):
    """The bounds of a process sent SIGINT or SIGTERM."""
    if not proc.wait(patience(SIGNALLED)):
        run.problem(proc, f"did not end within {patience(SIGNALLED):.1f} s of {name}")
        return
    if python_starting(proc, signum):
        run.trial.starting = True
        return
    lines = proc.stderr_lines()
    if proc.rc == 0 and not lines and proc.ended - since <= patience(AFTER_MAIN):
        run.trial.missed = True  # it had done its work: from main's return on, a program is
        return                   # deaf to signals (common/cli.py _leave)
    if proc.rc is not None and proc.rc != 128 + signum:
        run.problem(proc, f"on {name}, not exit {128 + signum}", since)
    elif any("Traceback" in line for line in proc.own_err()):
        run.problem(proc, f"a traceback on {name}", since)
    elif len(lines) != 1:
        run.problem(proc, f"{len(lines)} lines on stderr on {name}, not one", since)


def python_dropped(err):
    """Whether CPython itself printed a KeyboardInterrupt and ran the program on, at its start
    before any code of ours had the signals: a lost Ctrl-C that no program can see."""
    return PYTHON_RAN_ON in err or bool(PYTHON_IGNORED.search(err))


def python_starting(proc, signum):
    """Whether the signal ended the victim while Python itself was still starting, before the
    program's first import of ours gave the signals to our handlers (common/__init__): the
    signal's default action, Python's fatal error in its own start, or a KeyboardInterrupt
    raised at that first import (tests/test_bounds.py allows the same). Milliseconds of a
    start, which no code of ours can reach."""
    err = "".join(proc.own_err())
    if "Fatal Python error" in err or python_dropped(err):
        return True
    if "Traceback" not in err:
        return proc.exit_code() == -signum
    frames = re.findall(r'File "([^"]+)", line \d+, in \S+\n\s*(.*)', err)
    ours = [(path, code) for path, code in frames
            if path.startswith(str(ROOT)) and "site-packages" not in path]
    if not err.rstrip().endswith("KeyboardInterrupt"):
        return False
    # no frame of ours at all: Python's own start (site, an editable install's finder)
    # had not yet run the program's first line
    return not ours or (all(not path.startswith(str(ROOT / "common")) for path, _ in ours)
                        and re.match(r"(import|from) common\b", ours[-1][1]) is not None)


def survivor_ok(run, proc, bound, since, after="after its peer's fault"):
    """The bounds of a process whose peer was signalled, killed, frozen or continued, or
    which was continued itself: it ends within `bound` of `since`, with exit 0 and no
    wrong byte, or with one line on stderr and a non-zero exit."""
    if not proc.wait(max(0.0, since + bound - time.monotonic())):
        run.problem(proc, f"still running {bound:.1f} s {after}")
        return
    lines, failed = proc.stderr_lines(), proc.rc != 0  # a rank's exit code is not ours
    if proc.rc is not None and proc.rc < 0:
        run.problem(proc, f"killed by {signal.Signals(-proc.rc).name}", since)
    elif any("Traceback" in line for line in lines):  # its own: a launcher passes on its
        run.problem(proc, "a traceback", since)          # ranks' lines, each judged apart
    elif WRONG.search("".join(getattr(proc, "out", [])) + "".join(proc.err)):
        run.problem(proc, f"reports wrong bytes {after}", since)
    elif failed and len(lines) > 1 or proc.rc not in (None, 0) and not lines:
        run.problem(proc, f"{len(lines)} lines on stderr, not one", since)

"""Fault injection: a signal or a dead peer in the middle of real runs, and the bounds checked.

A trial runs one chapter on shm or tcp, as a server and a client (04-07, 09-15, 18) or as
ranks under scripts/launch.py (16, 19), each started in a session of its own with the
trial's token in its environment. At a random moment after the client (or the ranks)
started, one process (the victim) gets one fault: SIGINT, SIGTERM, SIGKILL, or SIGSTOP (a
frozen peer, kept stopped, killed at the end of the trial). Then it checks that

- the signalled process ends within 2 s with exit 130 (SIGINT) or 143 (SIGTERM) and one
  line on stderr, no traceback;
- every other process ends within its --timeout + 5 s, with one line on stderr when it
  failed, no traceback and no wrong bytes claimed; a server that serves more clients
  serves a second one instead, which must succeed; every rank and the launcher end;
- no process carrying the token is left, nor a /dev/shm file of the trial's processes.

A fault that comes while Python itself still starts (before the program's first import of
ours takes the signals: python_starting) ends the victim Python's way; such a trial counts
only if a survivor failed, and the figure says how many there were.

Every wait is stretched by the machine's load, as the chapters' own are (common/patience).
What is left after a failed trial is killed and removed, so that the next starts clean.
Trial K of a --seed is always the same trial: `--only K` with the same flags reruns it.

    .venv/bin/python scripts/chaos.py --trials 60 --minutes 12
    .venv/bin/python scripts/chaos.py --chapters 07,15 --providers shm --faults SIGKILL,SIGSTOP \\
        --victims client --seed 3 --only 5
"""
import argparse
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from common import records, usage
from common.chapter_pair import ADDRESS, ROOT, chapter_path, local_env
from common.patience import patience

TOKEN = "CHAOS_TRIAL"
SHM = Path("/dev/shm")
PIDS = re.compile(r"^launch: .*; pids ([\d ]+)$", re.MULTILINE)
WRONG = re.compile(r"\b[1-9]\d* wrong bytes")
FAULTS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL,
          "SIGSTOP": signal.SIGSTOP}
PROVIDERS = ("shm", "tcp")
VICTIMS = ("server", "client", "rank", "launcher")
TIMEOUT = 5.0   # the chapters' --timeout in a trial
SIGNALLED = 2.0  # seconds a signalled process may take to end
# CPython's start prints this when a KeyboardInterrupt cuts into its look at argv[0] (is it
# a zip to import from?), and runs the program on: the Ctrl-C is lost before any code of ours
PYTHON_RAN_ON = "Failed checking if argv[0] is an import path entry"
# ... and this when one lands in a callback of its own import system (a module lock's,
# collected), which it may not raise from: "Exception ignored", and the program runs on
PYTHON_IGNORED = re.compile(r'Exception ignored in: .*\nTraceback \(most recent call last\):\n'
                            r'(  File "<frozen [^"]+".*\n)+KeyboardInterrupt')
GRACE = 2.0      # the launcher's --grace: seconds the ranks get to stop by themselves


@dataclass
class Spec:
    """How a chapter runs in a trial."""
    kind: str                  # "pair" or "ranks"
    server: list = field(default_factory=list)  # server (or launcher) arguments
    client: list = field(default_factory=list)  # client (or each rank's) arguments
    window: float = 3.0        # the fault lands within this many seconds of the start...
    from_output: bool = False  # ...of the client's first line (else of its launch)
    again: list = None         # a server serving more: the second client's arguments
    program: Path = None       # what runs, if not the chapter's file (the tests' fakes)
    begun: str = None          # the window opens at the server's line with this (peers joined)


PAGES = ["--page-size", "4K", "--buffer-size", "1M", "--pages", "0-63"]


def engine(iters):
    """Chapters 07 and 09-15: WRITEs enough to last past the window; a short second run."""
    return Spec("pair", ["--clients", "2"], [*PAGES, "--iters", str(iters)], 3.0, True,
                [*PAGES, "--iters", "1000"])


SPECS = {
    "04": Spec("pair", window=0.8, again=[]),
    "05": Spec("pair", ["--clients", "2"], window=1.5, again=[]),
    "06": Spec("pair", ["--clients", "2"], ["--buffer-size", "64M", "--page-size", "1M",
                                            "--pages", "0-63"], 2.0, again=[]),
    "07": engine(1_000_000),
    "09": engine(600_000), "10": engine(300_000),
    **{c: engine(4_000_000) for c in ("11", "12", "13", "14", "15")},
    "16": Spec("ranks", ["-n", "4", "--ranks-per-node", "2"],
               ["--check", "random", "--iters", "20", "--tokens", "64"], 8.0),
    "18": Spec("pair", ["--tokens", "4096"], ["--tokens", "4096"], 4.0,
               begun="decoder: request"),
    "19": Spec("ranks", ["-n", "3"], ["--updates", "3", "--naive", "no"], 8.0),
}


# --- processes -------------------------------------------------------------------------

class Proc:
    """One process of a trial: started in a session of its own, both streams collected."""

    def __init__(self, name, args, env):
        self.name, self.args = name, args
        self.popen = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env, cwd=ROOT, start_new_session=True)
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

    def stderr_lines(self):
        return [line for line in self.err if line.strip()]


class Launcher(Proc):
    """scripts/launch.py: its own lines are those not prefixed by a rank, less the first
    (which ranks it started)."""

    def stderr_lines(self):
        return [line for line in self.err if line.strip() and not re.match(r"\[\d+\] ", line)
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

    @property
    def err(self):
        n = len(self.prefix)
        return [line[n:] for line in self.launcher.err if line.startswith(self.prefix)]

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


# --- a trial --------------------------------------------------------------------------

@dataclass
class Trial:
    number: int
    chapter: str
    provider: str
    victim: str
    fault: str
    moment: float  # seconds into the window
    pick: int      # which rank, when the victim is a rank
    commands: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    missed: bool = False  # the victim had ended before the fault
    starting: bool = False  # ... or was still in Python's own start (python_starting)
    seconds: float = 0.0

    @property
    def survived(self):
        return not self.problems and not self.missed and not self.starting

    @property
    def counted(self):
        """Whether the trial tested our bounds: a victim still in Python's own start tests
        only the survivors, and counts if one of them failed."""
        return not self.missed and (self.problems or not self.starting)

    def record(self):
        return {"trial": self.number, "chapter": self.chapter, "provider": self.provider,
                "victim": self.victim, "fault": self.fault, "moment_s": round(self.moment, 3),
                "survived": self.survived, "missed": self.missed, "starting": self.starting,
                "problems": self.problems,
                "commands": [records.arguments(c) for c in self.commands],
                "seconds": round(self.seconds, 1)}


def choose(number, seed, chapters, providers, faults, victims):
    """Trial `number` of `seed`: the same choices whenever asked with the same flags."""
    rng = random.Random(f"{seed}:{number}")
    chapter = rng.choice([c for c in chapters if sides(c, victims)])
    return Trial(number, chapter, rng.choice(providers), rng.choice(sides(chapter, victims)),
                 rng.choice(faults), rng.uniform(0.0, SPECS[chapter].window), rng.randrange(1 << 16))


def sides(chapter, victims):
    """Who can be the victim in a chapter: server or client of a pair; a rank or the
    launcher of ranks."""
    own = ("server", "client") if SPECS[chapter].kind == "pair" else ("rank", "launcher")
    return [v for v in victims if v in own]


class Run:
    """The processes of one trial, and what is found wrong with them."""

    def __init__(self, trial):
        self.trial, self.token = trial, uuid.uuid4().hex
        self.env = local_env({TOKEN: self.token})
        self.procs = []
        self.killed = set()  # pids killed by SIGKILL: their shm regions are this run's to remove
        self.watch = Watch(self.token)

    def start(self, name, args, kind=Proc):
        self.trial.commands.append(args)
        proc = kind(name, args, self.env)
        self.procs.append(proc)
        return proc

    def problem(self, proc, what, since=None):
        took = f" after {proc.ended - since:.1f} s" if since and proc.ended else ""
        tail = "".join(proc.err[-3:]).strip().replace("\n", " | ").replace(f"{ROOT}{os.sep}", "")
        rc = f", exit {proc.rc}" if getattr(proc, "rc", None) is not None else ""
        self.trial.problems.append(f"{proc.name}: {what}{took}{rc}"
                                   + (f"; stderr: {tail}" if tail else ""))

    def close(self):
        """Kill what is still running, stop the watch, report and remove what was left."""
        for proc in self.procs:
            if proc.alive():
                self.killed.add(proc.pid)
                proc.kill()
        self.watch.stop()
        time.sleep(0.1)  # let the killed go before /proc is read again
        for pid in carriers(self.token):
            self.trial.problems.append(f"left running: pid {pid} "
                                       f"{Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
            self.killed.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.killed.update(p.pid for p in self.procs if p.rc == -signal.SIGKILL)
        pids = self.watch.pids | {p.pid for p in self.procs}
        files = leftovers(pids, self.watch.files)
        # A process killed by SIGKILL cannot remove its own region; whoever killed it
        # must (so a launcher must for its ranks: common/launch.py _remove_leftovers).
        left = [f for f in files if f.split(":")[0] not in {str(p) for p in self.killed}]
        owners = {str(p.pid): p.name for p in self.procs}
        if left:
            self.trial.problems.append(f"left in {SHM}: " + " ".join(
                f"{f} ({owners.get(f.split(':')[0], 'of the trial')})" for f in left))
        for name in files:
            (SHM / name).unlink(missing_ok=True)


def wait_for(condition, seconds):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def signalled_ok(run, proc, fault, since):
    """The bounds of the process the fault was sent to."""
    if fault == "SIGSTOP":
        return
    if fault == "SIGKILL":
        if not proc.wait(patience(SIGNALLED)):
            run.problem(proc, "still alive after SIGKILL")
        return
    if not proc.wait(patience(SIGNALLED)):
        run.problem(proc, f"did not end within {patience(SIGNALLED):.1f} s of {fault}")
        return
    if python_starting(proc, fault):
        run.trial.starting = True
        return
    lines = proc.stderr_lines()
    if proc.rc is not None and proc.rc != 128 + FAULTS[fault]:
        run.problem(proc, f"on {fault}, not exit {128 + FAULTS[fault]}", since)
    elif any("Traceback" in line for line in proc.err):
        run.problem(proc, f"a traceback on {fault}", since)
    elif len(lines) != 1:
        run.problem(proc, f"{len(lines)} lines on stderr on {fault}, not one", since)


def python_dropped(err):
    """Whether CPython itself printed a KeyboardInterrupt and ran the program on, at its start
    before any code of ours had the signals: a lost Ctrl-C that no program can see."""
    return PYTHON_RAN_ON in err or bool(PYTHON_IGNORED.search(err))


def python_starting(proc, fault):
    """Whether the fault ended the victim while Python itself was still starting, before the
    program's first import of ours gave the signals to our handlers (common/__init__): the
    signal's default action, Python's fatal error in its own start, or a KeyboardInterrupt
    raised at that first import (tests/test_bounds.py allows the same). Milliseconds of a
    start, which no code of ours can reach."""
    err = "".join(proc.err)
    if "Fatal Python error" in err or python_dropped(err):
        return True
    if "Traceback" not in err:
        return proc.rc is not None and proc.rc == -FAULTS[fault]
    frames = re.findall(r'File "([^"]+)", line \d+, in \S+\n\s*(.*)', err)
    ours = [(path, code) for path, code in frames
            if path.startswith(str(ROOT)) and "site-packages" not in path]
    return (err.rstrip().endswith("KeyboardInterrupt") and bool(ours)
            and all(not path.startswith(str(ROOT / "common")) for path, _ in ours)
            and re.match(r"(import|from) common\b", ours[-1][1]) is not None)


def survivor_ok(run, proc, bound, since):
    """The bounds of a process whose peer was signalled, killed or frozen."""
    if not proc.wait(max(0.0, since + bound - time.monotonic())):
        run.problem(proc, f"still running {bound:.1f} s after its peer's fault")
        return
    lines, failed = proc.stderr_lines(), proc.rc != 0  # a rank's exit code is not ours
    if proc.rc is not None and proc.rc < 0:
        run.problem(proc, f"killed by {signal.Signals(-proc.rc).name}", since)
    elif any("Traceback" in line for line in lines):  # its own: a launcher passes on its
        run.problem(proc, "a traceback", since)          # ranks' lines, each judged apart
    elif WRONG.search("".join(getattr(proc, "out", [])) + "".join(proc.err)):
        run.problem(proc, "reports wrong bytes after its peer's fault", since)
    elif failed and len(lines) > 1 or proc.rc not in (None, 0) and not lines:
        run.problem(proc, f"{len(lines)} lines on stderr, not one", since)


def land(run, victim, trial, start):
    """Wait for the trial's moment and send the fault; the time it was sent, or None when
    the victim had ended before."""
    wait_for(lambda: not victim.alive(), max(0.0, start + trial.moment - time.monotonic()))
    if not victim.alive():
        trial.missed = True
        return None
    os.kill(victim.pid, FAULTS[trial.fault])
    if trial.fault == "SIGKILL" and isinstance(victim, Proc):  # a rank's: the launcher's
        run.killed.add(victim.pid)
    return time.monotonic()


def pair_trial(run, trial, spec, bound):
    path = str(spec.program or chapter_path(trial.chapter))
    common = ["-p", trial.provider, "--timeout", f"{TIMEOUT:g}"]
    server = run.start("server", [sys.executable, path, *common, *spec.server])
    if not wait_for(lambda: ADDRESS.search("".join(server.out)) or not server.alive(),
                    patience(30)) or not server.alive():
        return run.problem(server, "printed no address")
    address = ADDRESS.search("".join(server.out))[1]
    client = run.start("client", [sys.executable, path, *common, address, *spec.client])
    if spec.from_output:
        wait_for(lambda: client.out or not client.alive(), patience(30))
    if spec.begun:  # before it, the server waits for a client, not for a peer
        wait_for(lambda: spec.begun in "".join(server.out) or not client.alive(), patience(30))
    victim, peer = (server, client) if trial.victim == "server" else (client, server)
    since = land(run, victim, trial, time.monotonic())
    if since is None:
        return
    signalled_ok(run, victim, trial.fault, since)
    if peer is server and spec.again is not None:
        return serves_next(run, trial, server, client, path, address, spec, since, bound)
    survivor_ok(run, peer, bound, since)


def serves_next(run, trial, server, client, path, address, spec, since, bound):
    """A server told to serve more clients: a second client must succeed. Chapter 04's server
    serves one message: if it had it before the fault, it has ended well, and no second
    client is due."""
    if not server.wait(0.1) or server.rc != 0:
        second_client(run, trial, server, path, address, spec, since, bound)
    client.kill()


def second_client(run, trial, server, path, address, spec, since, bound):
    """Started at once, it waits for the server as long as the server's bound allows: the
    server may still be waiting out the first client's --timeout."""
    wait = max(TIMEOUT, since + bound - time.monotonic())
    second = run.start("second client", [sys.executable, path, "-p", trial.provider,
                                          "--timeout", f"{wait:.1f}", address, *spec.again])
    if not second.wait(patience(30)):
        run.problem(second, f"did not finish within {patience(30):.1f} s")
    elif second.rc != 0:
        run.problem(second, "failed: the server did not serve the next client")
    if server.alive() and not wait_for(lambda: not server.alive(), patience(SIGNALLED)):
        server.popen.send_signal(signal.SIGINT)  # it may not count the first client: Ctrl-C
        if not server.wait(patience(SIGNALLED)):
            run.problem(server, "did not end within 2 s of SIGINT after its last client")
        elif server.rc != 130:
            run.problem(server, "Ctrl-C after its last client")
    elif server.rc != 0:
        run.problem(server, "failed serving its clients")


def ranks_trial(run, trial, spec, bound):
    launcher = run.start("launcher", [sys.executable, str(ROOT / "scripts" / "launch.py"),
                                      *spec.server, "--grace", f"{GRACE:g}",
                                      str(chapter_path(trial.chapter)), "-p", trial.provider,
                                      "--timeout", f"{TIMEOUT:g}", *spec.client], Launcher)
    if not wait_for(lambda: PIDS.search("".join(launcher.err)) or not launcher.alive(),
                    patience(30)) or not launcher.alive():
        return run.problem(launcher, "printed no pids")
    pids = [int(p) for p in PIDS.search("".join(launcher.err))[1].split()]
    ranks = [Rank(r, pid, launcher) for r, pid in enumerate(pids)]
    run.procs += ranks
    victim = launcher if trial.victim == "launcher" else ranks[trial.pick % len(ranks)]
    trial.victim = victim.name
    since = land(run, victim, trial, time.monotonic())
    if since is None:
        return
    signalled_ok(run, victim, trial.fault, since)
    for rank in ranks:
        if rank is not victim:
            survivor_ok(run, rank, bound, since)
    if victim is not launcher:
        # A frozen rank ends only when the launcher kills it: its grace, then SIGTERM, 5 s
        # later SIGKILL (common/launch.py spawn, _stop).
        late = GRACE + 5 if trial.fault == "SIGSTOP" else 0
        survivor_ok(run, launcher, bound + late, since)
        if not launcher.alive() and launcher.rc == 0:
            run.problem(launcher, "reports success after a rank's fault")


def run_trial(trial):
    spec, started = SPECS[trial.chapter], time.monotonic()
    run = Run(trial)
    bound = patience(TIMEOUT) + 5
    try:
        (pair_trial if spec.kind == "pair" else ranks_trial)(run, trial, spec, bound)
    finally:
        run.close()
        trial.seconds = time.monotonic() - started
    return trial


# --- the report -------------------------------------------------------------------------

def table(trials, faults, providers):
    """Survived/total per chapter (rows) x fault and provider (columns); misses not counted."""
    columns = [(f, p) for f in faults for p in providers]
    head = ["ch"] + [f"{f[3:]}/{p}" for f, p in columns]
    rows = []
    for chapter in sorted({t.chapter for t in trials}):
        row = [chapter]
        for f, p in columns:
            hit = [t for t in trials if (t.chapter, t.fault, t.provider) == (chapter, f, p)
                   and t.counted]
            row.append(f"{sum(t.survived for t in hit)}/{len(hit)}" if hit else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows)


def figure(trials):
    counted = [t for t in trials if t.counted]
    return f"faults survived {sum(t.survived for t in counted)}/{len(counted)}"


def describe(trial, rerun):
    lines = [f"trial {trial.number}: chapter {trial.chapter} {trial.provider}, {trial.fault} "
             f"to the {trial.victim} at {trial.moment:.2f} s ({trial.seconds:.1f} s); rerun: "
             f"{rerun} --only {trial.number}"]
    lines += [f"  $ {shlex.join(shown(c))}" for c in trial.commands]
    lines += [f"  {p}" for p in trial.problems]
    return "\n".join(lines)


def shown(args):
    """A command as run from the project's folder."""
    return [".venv/bin/python" if a == sys.executable else
            os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a for a in args]


def libfabric_version():
    """The libfabric the chapters run, asked of a child (libfabric stays out of this
    process, whose Ctrl-C must stay its own)."""
    done = subprocess.run([sys.executable, "-c", "import common.fabric as fi; "
                           "print('%d.%d' % fi.version())"], capture_output=True, text=True,
                          cwd=ROOT)
    return done.stdout.strip() or None


# --- the command line ------------------------------------------------------------------

def listed(choices, upper=False):
    def parse(text):
        items = [i.strip().upper() if upper else i.strip() for i in text.split(",")]
        items = [f"{int(i):02d}" if i.isdigit() and not upper else i for i in items]
        wrong = [i for i in items if i not in choices]
        if wrong or not items:
            raise argparse.ArgumentTypeError(f"'{text}': choose from {','.join(choices)}")
        return list(dict.fromkeys(items))
    return parse


def parser():
    p = usage.Parser(prog="chaos.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=usage.positive(int), default=20, help="how many trials")
    p.add_argument("--minutes", type=usage.positive(float), default=10.0,
                   help="start no trial after this many minutes")
    p.add_argument("--seed", type=int, default=0, help="the seed the trials are chosen from")
    p.add_argument("--only", type=usage.positive(int), metavar="K", help="run trial K alone")
    p.add_argument("--chapters", type=listed(tuple(SPECS)), default=list(SPECS))
    p.add_argument("--providers", type=listed(PROVIDERS), default=list(PROVIDERS))
    p.add_argument("--faults", type=listed(tuple(FAULTS), upper=True), default=list(FAULTS))
    p.add_argument("--victims", type=listed(VICTIMS), default=list(VICTIMS))
    p.add_argument("--json", type=records.parse_label, metavar="LABEL",
                   help="write the trials to results/chaos/LABEL.json")
    return p


def check(p, args):
    if not any(sides(c, args.victims) for c in args.chapters):
        p.error(f"no chapter of {','.join(args.chapters)} has a {','.join(args.victims)}")


def main(argv=None):
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    check(p, args)
    rerun = shlex.join(["scripts/chaos.py"] + drop_only(argv))
    numbers = [args.only] if args.only else range(1, args.trials + 1)
    deadline, trials = time.monotonic() + 60 * args.minutes, []
    for number in numbers:
        if time.monotonic() > deadline:
            print(f"chaos: {args.minutes:g} minutes are up; {len(trials)} trials run")
            break
        trial = run_trial(choose(number, args.seed, args.chapters, args.providers,
                                 args.faults, args.victims))
        trials.append(trial)
        verdict = "missed (the victim had ended)" if trial.missed else \
            "survived" if trial.survived else "FAILED" if trial.counted else \
            "missed (the victim was still in Python's own start)"
        print(f"trial {number}: {trial.chapter} {trial.provider} {trial.fault} -> "
              f"{trial.victim} at {trial.moment:.2f} s: {verdict} ({trial.seconds:.1f} s)",
              flush=True)
    failed = [t for t in trials if t.problems]
    for trial in failed:
        print("\n" + describe(trial, rerun))
    print("\n" + table(trials, args.faults, args.providers))
    missed = sum(t.missed for t in trials)
    starting = sum(not t.missed and not t.counted for t in trials)
    print(figure(trials) + "".join(
        f" ({n} missed: {why})" for n, why in (
            (missed, "the victim had ended before its fault"),
            (starting, "the victim was still in Python's own start")) if n))
    if args.json:
        out = records.write_json(ROOT / "results" / "chaos" / f"{args.json}.json", {
            "kind": "chaos", "command": "python " + shlex.join(["scripts/chaos.py",
                                                                *records.arguments(argv)]),
            "machine": records.machine(), "libfabric": libfabric_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git": records.git_sha(), "seed": args.seed, "figure": figure(trials),
            "trials": [t.record() for t in trials]})
        print(f"wrote {out.relative_to(ROOT)}")
    return 1 if failed else 0


def drop_only(argv):
    """The command line without its --only K, to which a failure's number is added."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--only":
            skip = True
        elif not a.startswith("--only="):
            out.append(a)
    return out


class Terminated(Exception):
    pass


def terminated(_signum, _frame):
    raise Terminated


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started ignoring it
    try:
        sys.exit(main())
    except (KeyboardInterrupt, Terminated) as e:  # the trial's processes were killed on the way
        print(f"chaos: {'terminated' if isinstance(e, Terminated) else 'interrupted'}; "
              "the trial's processes are killed", file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)

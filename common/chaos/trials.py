"""The trials of scripts/chaos.py: which chapters run how, which trial a seed's number K is,
and one trial run to its verdict.

The cells are chapter x fault x provider. Stratified, trial K of a seed is cell K mod the
number of cells in an order shuffled by the seed, so every cell comes once before any comes
twice; its victim takes each side in turn on the passes after. Drawn, a trial picks all at
random. Either way the instant is drawn over the victim's whole life: a fraction of the
cell's life, measured by one clean run of it (from the client's start, the server's "peers
joined" line or the launcher's ranks started, to the client's or the launcher's end).
"""
import os
import random
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from common import records
from common.chaos.faults import FAULTS, python_starting, survivor_ok
from common.chaos.procs import (PIDS, SHM, SIGNALLED, TOKEN, Launcher, Proc, Rank, Watch,
                                carriers, leftovers, signals_held, wait_for)
from common.chapter_pair import ADDRESS, ROOT, chapter_path, local_env
from common.patience import patience

PROVIDERS = ("shm", "tcp")
VICTIMS = ("server", "client", "rank", "launcher")
TIMEOUT = 2.0   # the chapters' --timeout in a trial on a quiet machine (stretched by the
                # load as the trial starts: a clean run must not take a busy peer for gone)
GRACE = 2.0     # the launcher's --grace: seconds the ranks get to stop by themselves


@dataclass
class Spec:
    """How a chapter runs in a trial."""
    kind: str                  # "pair" or "ranks"
    server: list = field(default_factory=list)  # server (or launcher) arguments
    client: list = field(default_factory=list)  # client (or each rank's) arguments
    again: list = None         # a server serving more: the second client's arguments
    program: Path = None       # what runs, if not the chapter's file (the tests' fakes)
    begun: str = None          # the life begins at the server's line with this (peers joined;
                               # 18's decoder took a request, the one it serves)


PAGES = ["--page-size", "4K", "--buffer-size", "1M", "--pages", "0-63"]


def engine(iters):
    """Chapters 07 and 09-15: WRITEs for a second or two; a short second run."""
    return Spec("pair", ["--clients", "2"], [*PAGES, "--iters", str(iters)],
                [*PAGES, "--iters", "1000"])


SPECS = {
    "04": Spec("pair", again=[]),
    "05": Spec("pair", ["--clients", "2"], again=[]),
    "06": Spec("pair", ["--clients", "2"], ["--buffer-size", "16M", "--page-size", "1M",
                                            "--pages", "0-15"], again=[]),
    "07": engine(100_000),
    "09": engine(75_000), "10": engine(50_000),
    **{c: engine(300_000) for c in ("11", "12")},
    **{c: engine(400_000) for c in ("13", "14", "15")},
    "16": Spec("ranks", ["-n", "4", "--ranks-per-node", "2"],
               ["--check", "random", "--iters", "3", "--tokens", "64", "--max-tokens", "64",
                "--hidden", "256", "--experts", "16", "--topk", "4"]),
    "18": Spec("pair", ["--tokens", "4096"], ["--tokens", "4096"], ["--tokens", "4096"],
               begun="decoder: request"),
    "19": Spec("ranks", ["-n", "3"], ["--model", "tiny", "--updates", "2", "--naive", "no"]),
}
LIVES = {}  # (chapter, provider) -> seconds of a clean run's life, measured once a process


@dataclass
class Trial:
    number: int
    chapter: str
    provider: str
    victim: str
    fault: str
    at: float      # the instant, as a fraction of the victim's life
    extra: float   # the fault's own draw (a pause, a --timeout), from 0 to 1
    pick: int = 0  # which rank, when the victim is a rank
    commands: list = field(default_factory=list)
    problems: list = field(default_factory=list)
    missed: bool = False    # the victim had ended before the fault
    starting: bool = False  # ... or was still in Python's own start (python_starting)
    life: float = 0.0       # seconds: the cell's clean life
    detail: str = ""        # what the fault drew (a pause, a --timeout)
    seconds: float = 0.0

    @property
    def cell(self):
        return (self.chapter, self.fault, self.provider)

    @property
    def moment(self):
        return self.at * self.life

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
                "victim": self.victim, "fault": self.fault, "at": round(self.at, 3),
                "moment_s": round(self.moment, 3), "life_s": round(self.life, 2),
                "detail": self.detail, "survived": self.survived, "missed": self.missed,
                "starting": self.starting, "problems": self.problems,
                "commands": [records.arguments(c) for c in self.commands],
                "seconds": round(self.seconds, 1)}


def sides(chapter, fault, victims):
    """Who can be the victim of `fault` in a chapter: server or client of a pair; a rank or
    the launcher of ranks."""
    own = ("server", "client") if SPECS[chapter].kind == "pair" else ("rank", "launcher")
    if FAULTS[fault].chapters and chapter not in FAULTS[fault].chapters:
        return []
    return [v for v in victims if v in own and v in FAULTS[fault].victims]


def cells(chapters, faults, providers, victims):
    """The chapter x fault x provider cells that have a victim among `victims`."""
    return [(c, f, p) for c in chapters for f in faults for p in providers
            if sides(c, f, victims)]


def choose(number, seed, chapters, providers, faults, victims, stratified=False):
    """Trial `number` of `seed`: the same choices whenever asked with the same flags."""
    rng = random.Random(f"{seed}:{number}")
    every = cells(chapters, faults, providers, victims)
    if stratified:
        random.Random(f"{seed}:cells").shuffle(every)
        turn, i = divmod(number - 1, len(every))
        chapter, fault, provider = every[i]
        own = sides(chapter, fault, victims)  # each side in turn, from a side the seed drew
        victim = own[(turn + random.Random(f"{seed}:{every[i]}").randrange(len(own)))
                     % len(own)]
    else:
        chapter, fault, provider = rng.choice(every)
        victim = rng.choice(sides(chapter, fault, victims))
    return Trial(number, chapter, provider, victim, fault, rng.random(), rng.random(),
                 rng.randrange(1 << 16))


class Run:
    """The processes of one trial, and what is found wrong with them."""

    def __init__(self, trial):
        self.trial, self.token = trial, uuid.uuid4().hex
        self.timeout = round(patience(TIMEOUT), 1)  # the chapters' --timeout
        self.env = local_env({TOKEN: self.token})
        self.procs = []
        self.killed = set()  # pids killed by SIGKILL: their shm regions are this run's to remove
        self.continued = None  # when a stopped victim was continued, plus the rest of its life
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
        """Kill what is still running, stop the watch, report and remove what was left.
        A Ctrl-C meanwhile waits for it (a tenth of a second): all is killed first."""
        with signals_held():
            self._close()

    def _close(self):
        for proc in self.procs:
            if proc.alive():
                self.killed.add(proc.pid)
                proc.kill()
        self.watch.stop()
        time.sleep(0.1)  # let the killed go before /proc is read again
        for pid in carriers(self.token):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()[:120]
            except OSError:  # it ended meanwhile
                continue
            self.trial.problems.append(f"left running: pid {pid} {command!r}")
            self.killed.add(pid)
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # ours where a signal cut in before run.start kept it
            except (ProcessLookupError, ChildProcessError):
                pass
        self.killed.update(p.pid for p in self.procs if p.rc == -signal.SIGKILL)
        pids = self.watch.pids | {p.pid for p in self.procs}
        files = leftovers(pids, self.watch.files)
        # A process killed by SIGKILL cannot remove its own region; whoever killed it must
        # (a launcher for its ranks: common/launch/launcher.py, shm_files.remove_left_by)
        left = [f for f in files if f.split(":")[0] not in {str(p) for p in self.killed}]
        owners = {str(p.pid): p.name for p in self.procs}
        if left:
            self.trial.problems.append(f"left in {SHM}: " + " ".join(
                f"{f} ({owners.get(f.split(':')[0], 'of the trial')})" for f in left))
        for name in files:
            (SHM / name).unlink(missing_ok=True)


def start_pair(run, spec, fault=None):
    """The server, then the client (`fault` may change its command); with the address and
    the instant the client's life begins. None where the server gave no address."""
    trial = run.trial
    path = str(spec.program or chapter_path(trial.chapter))
    common = ["-p", trial.provider, "--timeout", f"{run.timeout:g}"]
    server = run.start("server", [sys.executable, path, *common, *spec.server])
    if not wait_for(lambda: ADDRESS.search("".join(server.out)) or not server.alive(),
                    patience(30)) or not server.alive():
        return run.problem(server, "printed no address")
    address = ADDRESS.search("".join(server.out))[1]
    args = [sys.executable, path, *common, address, *spec.client]
    if fault and trial.victim == "client":
        args = fault.client(trial, args, address)
    client = run.start("client", args)
    origin = time.monotonic()
    if spec.begun:  # before it, the server waits for a client, not for a peer
        wait_for(lambda: spec.begun in "".join(server.out) or not client.alive(), patience(30))
        origin = time.monotonic()
    return server, client, path, address, origin


def pair_trial(run, spec, bound):
    trial, fault = run.trial, FAULTS[run.trial.fault]
    started = start_pair(run, spec, fault)
    if started is None:
        return
    server, client, path, address, origin = started
    victim, peer = (server, client) if trial.victim == "server" else (client, server)
    since = fault.deal(run, victim, trial, origin, run.timeout)
    if since is None:
        return
    if victim is server and not fault.lethal and spec.again is not None:
        survivor_ok(run, client, bound, since)  # the continued server serves the next
        return serves_next(run, trial, server, client, path, address, spec, since, bound)
    fault.judge(run, victim, since, bound)
    if peer is server and spec.again is not None:
        return serves_next(run, trial, server, client, path, address, spec, since, bound)
    survivor_ok(run, peer, bound, since)


def serves_next(run, trial, server, client, path, address, spec, since, bound):
    """A server told to serve more clients: a second client must succeed. Chapter 04's server
    serves one message: if it had it before the fault, it has ended well, and no second
    client is due. Chapter 18's decoder serves one request: once it took the faulty client's
    (it said its `begun` line), it is held to a survivor's bounds, and no second client is due;
    until then it waits on for one (a lie, a client that gave up before asking)."""
    if spec.begun:
        wait_for(lambda: spec.begun in "".join(server.out) or not server.alive(), patience(1))
        if spec.begun in "".join(server.out):
            if trial.victim == "server":  # stopped and continued: bound from its continue
                FAULTS[trial.fault].judge(run, server, since, bound)
            else:
                survivor_ok(run, server, bound, since)
            client.kill()
            return
    if not server.wait(0.1) or server.rc != 0:
        second_client(run, trial, server, path, address, spec, since, bound)
    client.kill()


def second_client(run, trial, server, path, address, spec, since, bound):
    """Started at once, it waits for the server as long as the server's bound allows: the
    server may still be waiting out the first client's --timeout."""
    wait = max(run.timeout, since + bound - time.monotonic())
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


def start_ranks(run, spec, fault=None):
    """The launcher and its ranks (`fault` may change their command), with the instant the
    ranks were started; None where the launcher told no pids."""
    trial = run.trial
    ranks_args = [str(chapter_path(trial.chapter)), "-p", trial.provider,
                  "--timeout", f"{run.timeout:g}", *spec.client]
    if fault and trial.victim == "rank":
        ranks_args = fault.client(trial, ranks_args, None)
    launcher = run.start("launcher", [sys.executable, str(ROOT / "scripts" / "launch.py"),
                                      *spec.server, "--grace", f"{GRACE:g}", *ranks_args],
                         Launcher)
    if not wait_for(lambda: PIDS.search("".join(launcher.err)) or not launcher.alive(),
                    patience(30)) or not launcher.alive():
        return run.problem(launcher, "printed no pids")
    origin = time.monotonic()
    pids = [int(p) for p in PIDS.search("".join(launcher.err))[1].split()]
    ranks = [Rank(r, pid, launcher) for r, pid in enumerate(pids)]
    run.procs += ranks
    return launcher, ranks, origin


def ranks_trial(run, spec, bound):
    trial, fault = run.trial, FAULTS[run.trial.fault]
    started = start_ranks(run, spec, fault)
    if started is None:
        return
    launcher, ranks, origin = started
    if trial.victim == "launcher":
        victim = launcher
    elif fault.own_end:  # every rank has the short --timeout: the first to end is the victim
        wait_for(lambda: not all(r.alive() for r in ranks),
                 patience(trial.life) + run.timeout + 5)
        victim = next((r for r in ranks if not r.alive()), ranks[0])
    else:
        victim = ranks[trial.pick % len(ranks)]
    trial.victim = victim.name
    since = fault.deal(run, victim, trial, origin, run.timeout)
    if since is None:
        return
    fault.judge(run, victim, since, bound)
    passed_on = victim is launcher and fault.signum in (signal.SIGINT, signal.SIGTERM)
    for rank in ranks:
        if rank is victim:
            continue
        if passed_on and rank.wait(patience(SIGNALLED)) and python_starting(rank, fault.signum):
            continue  # the launcher passed its signal on to a rank still in Python's start
        survivor_ok(run, rank, bound, since)
    if victim is not launcher:
        survivor_ok(run, launcher, bound + fault.late(GRACE), since)
        failed = fault.lethal or any(r.stderr_lines() for r in ranks)
        if not launcher.alive() and launcher.rc == 0 and failed:
            run.problem(launcher, "reports success after a rank's fault")


def life(chapter, provider):
    """The cell's life: seconds from its start to its end in a clean run, measured once;
    None, with the clean run's failure, where it did not end well (measured again for the
    cell's next trial)."""
    key = (chapter, provider)
    if key in LIVES:
        return LIVES[key]
    measured = clean_life(Trial(0, chapter, provider, "", "", 0.0, 0.0))
    if measured[0] is not None:
        LIVES[key] = measured
    return measured


def clean_life(trial):
    run, spec = Run(trial), SPECS[trial.chapter]
    try:
        started = (start_pair if spec.kind == "pair" else start_ranks)(run, spec)
        if started is None:
            return None, trial.problems
        last = started[1] if spec.kind == "pair" else started[0]
        if not last.wait(patience(60)) or last.rc != 0:
            run.problem(last, "did not end well in a clean run")
            return None, trial.problems
        return last.ended - started[-1], []
    finally:
        run.close()


def run_trial(trial):
    spec, started = SPECS[trial.chapter], time.monotonic()
    trial.life, failed = life(trial.chapter, trial.provider)
    if trial.life is None:
        trial.life, trial.problems = 0.0, [f"clean run: {p}" for p in failed]
        return trial
    run = Run(trial)
    bound = run.timeout + 5
    try:
        (pair_trial if spec.kind == "pair" else ranks_trial)(run, spec, bound)
    finally:
        run.close()
        trial.seconds = time.monotonic() - started
    return trial

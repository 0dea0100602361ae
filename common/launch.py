"""Multi-process runs: who am I (rank, world, node, GPU), a rendezvous, and a launcher.

A rank learns its place from the environment, under the names torchrun uses
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or
those Slurm's srun sets (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NTASKS_PER_NODE; MASTER_ADDR and MASTER_PORT from the job script), so
a program started by either runs one rank per process on a real cluster. Our
own launcher (spawn, below; scripts/launch.py) sets the torchrun names for W
ranks on this host, where `--ranks-per-node L` makes each block of L ranks an
emulated node, plus RANK_GPU and RENDEZVOUS (the address it serves).

The rendezvous is one TCP server: every rank connects, says who it is, and can
then `allgather` bytes (libfabric addresses, MR keys, shared-memory names,
CUDA IPC handles) and `barrier`. The launcher serves it itself; under
torchrun or Slurm, rank 0 serves it on MASTER_PORT + 1 (torchrun's own store
holds MASTER_PORT). The server also watches: a rank whose connection closes
before it said goodbye is gone (killed, crashed), and every other rank is
told so. Ranks ask (`check`, cheap, from their wait loops), so they stop
within a bounded time with a clear message instead of waiting forever. A
gather that runs out of time asks the rendezvous which ranks have not come
(an answer within LATE_ANSWER), so that its line names them.

A frozen rank (SIGSTOP, a host that stopped answering) closes nothing, so each
side also says that it lives, every ALIVE_EVERY seconds, from a thread of its
own: a rank that gave no sign of life for as long as it said at its join it
may be silent (its --timeout) stops the job as a dead one does, and a rank that
hears nothing from the rendezvous that long stops by itself. Before its join a
rank cannot say it; our launcher says it for each rank whose process runs (not
stopped), so one frozen at its start is seen the same way.
"""
import contextlib
import ctypes
import math
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from common import shm_files

FRAME = struct.Struct("<IB")   # payload length, message type
HELLO = struct.Struct("<IIId")  # rank, world size, ranks per node, seconds it may be silent
JOIN, WELCOME, GATHER, GATHERED, ABORT, BYE, ALIVE, LATE, MISSING = range(1, 10)
LENGTH = struct.Struct("<I")
SECONDS = struct.Struct("<d")
CHECK_EVERY = 0.01  # seconds between two looks at the rendezvous from a wait loop
ALIVE_EVERY = 0.5   # seconds between two signs of life (at most a quarter of the silence)
LATE_ANSWER = 0.5   # seconds a rank whose gather ran out waits to hear who is missing


class PeerGone(ConnectionError):
    """Another rank (or the rendezvous) is gone; this rank must stop."""


# --- who am I ----------------------------------------------------------------

@dataclass
class Place:
    rank: int
    world: int
    ranks_per_node: int
    gpu: int | None
    rendezvous: tuple   # (host, port)
    serve: bool         # this rank serves the rendezvous (rank 0 under torchrun/Slurm)
    source: str         # where the above came from, for the reader

    @property
    def node(self):
        return self.rank // self.ranks_per_node

    @property
    def nodes(self):
        return self.world // self.ranks_per_node


def _int(env, name):
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ValueError(f"environment variable {name} must be an integer, "
                         f"got {env.get(name)!r}") from None


def place_from_environment(env=None):
    """This process's Place, from our launcher's, torchrun's or Slurm's variables;
    one rank of one (nothing to rendezvous with) when none are set."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        per_node = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        source = "scripts/launch.py" if "RENDEZVOUS" in env else "torchrun variables"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        per_node = _int(env, "SLURM_NTASKS_PER_NODE") if "SLURM_NTASKS_PER_NODE" in env \
            else world
        source = "Slurm variables"
    else:
        return Place(0, 1, 1, None, None, False, "no launcher: one rank")
    if not 0 <= rank < world or per_node < 1 or world % per_node:
        raise ValueError(f"rank {rank} of world {world} with {per_node} ranks per node "
                         "does not make sense")
    gpu = int(env["RANK_GPU"]) if env.get("RANK_GPU", "").isdigit() else None
    if "RENDEZVOUS" in env:
        host, _, port = env["RENDEZVOUS"].rpartition(":")
        return Place(rank, world, per_node, gpu, (host, int(port)), False, source)
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise ValueError(f"{source} found, but no MASTER_ADDR and MASTER_PORT to meet at "
                         "(Slurm: export them in the job script, e.g. the first host of "
                         "SLURM_JOB_NODELIST and a free port)")
    return Place(rank, world, per_node, gpu, (env["MASTER_ADDR"], _int(env, "MASTER_PORT") + 1),
                 rank == 0, source)


# --- messages ------------------------------------------------------------------

def _send(sock, kind, payload=b""):
    sock.sendall(FRAME.pack(len(payload), kind) + payload)


def _recv_exact(sock, size):
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _recv(sock):
    size, kind = FRAME.unpack(_recv_exact(sock, FRAME.size))
    return kind, _recv_exact(sock, size)


def _pack_list(items):
    return b"".join(LENGTH.pack(len(i)) + i for i in items)


def _unpack_list(data):
    items, at = [], 0
    while at < len(data):
        (size,), at = LENGTH.unpack_from(data, at), at + LENGTH.size
        items.append(data[at:at + size])
        at += size
    return items


# --- the server ------------------------------------------------------------------

class RendezvousServer(threading.Thread):
    """Serves one job of `world` ranks: joins, allgathers, and the news of a rank gone."""

    def __init__(self, world, ranks_per_node, host="127.0.0.1", port=0, join_timeout=60.0):
        super().__init__(daemon=True)
        self.world, self.ranks_per_node, self.join_timeout = world, ranks_per_node, join_timeout
        self.job = secrets.token_hex(4)  # names this job's shared-memory files
        self.listener = socket.create_server((host, port), reuse_port=False)
        self.address = self.listener.getsockname()[:2]
        self.ranks = {}        # rank -> socket
        self.gathered = {}     # rank -> payload of the allgather in progress
        self.left = set()      # ranks that said goodbye
        self.heard = {}        # rank -> when it last gave a sign of life (time.monotonic())
        self.silence = {}      # rank -> seconds it may be silent, as it said at its join
        self.silent = None     # the rank that fell silent, once one did
        self.failure = None    # the first reason the job stopped
        self.gone = None       # the first rank whose connection closed without a goodbye
        self.lock = threading.Lock()
        self.start()

    def alive(self, rank):
        """A sign of life of a rank that has not joined yet, from whoever sees its process
        run (the launcher): once another rank joined, it may be as silent as that one."""
        if rank not in self.silence:
            self.heard[rank] = time.monotonic()

    def waiting_for(self):
        """The ranks that have not joined yet."""
        return set(range(self.world)) - set(self.silence)

    def abort(self, why):
        """Tell every rank (now, and any that joins later) that the job is over.
        Called from the launcher's thread too: sends hold the lock, so frames never mix."""
        with self.lock:
            if self.failure is None:
                self.failure = why
            for sock in list(self.ranks.values()):
                try:
                    _send(sock, ABORT, self.failure.encode())
                except OSError:
                    pass

    def run(self):
        started = beat = time.monotonic()
        sockets = {self.listener: None}  # socket -> rank (None: not joined yet)
        while not self._over():
            now = time.monotonic()
            if len(self.ranks) < self.world and self.failure is None \
                    and now - started > self.join_timeout:
                self.abort(f"only {len(self.ranks)} of {self.world} ranks joined the "
                           f"rendezvous within {self.join_timeout:g} s")
            self._find_silent(now)
            if now >= beat:
                self._say_alive()
                beat = now + self._every()
            readable, _, _ = select.select(list(sockets), [], [], min(0.1, self._every()))
            for sock in readable:
                if sock is self.listener:
                    conn, _ = self.listener.accept()
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    # a frame that stops halfway (its sender frozen) or a send that finds
                    # no room must not hold the server: that connection counts as closed
                    conn.settimeout(self.join_timeout)
                    sockets[conn] = None
                    continue
                try:
                    kind, payload = _recv(sock)
                except (EOFError, OSError):
                    kind, payload = None, b""
                rank = sockets[sock]
                if rank is not None:
                    self.heard[rank] = time.monotonic()
                if kind is None:  # closed: gone without a goodbye, unless it said one
                    del sockets[sock]
                    sock.close()
                    if rank is not None and rank not in self.left:
                        with self.lock:
                            self.ranks.pop(rank, None)
                        if self.gone is None:
                            self.gone = rank
                        self.abort(f"rank {rank} is gone (its connection to the rendezvous "
                                   "closed without a goodbye: killed or crashed)")
                elif kind == JOIN:
                    sockets[sock] = self._join(sock, payload)
                elif kind == GATHER:
                    self._gather(rank, payload)
                elif kind == LATE:
                    self._late(rank, sock, *SECONDS.unpack(payload))
                elif kind == BYE:
                    self.left.add(rank)
                    if self.gathered and rank not in self.gathered:
                        self.abort(f"rank {rank} finished while the others still wait for it")
        for sock in sockets:
            sock.close()

    def _over(self):
        """Every rank said goodbye, or the job stopped and those still connected are silent
        (frozen): nobody is left to serve, and rank 0 serving it need not wait longer."""
        if len(self.left) == self.world:
            return True
        now = time.monotonic()
        return self.failure is not None and all(
            now - self.heard[r] > self.silence[r] for r in set(self.ranks) - self.left)

    def _every(self):
        return min([ALIVE_EVERY] + [s / 4 for s in self.silence.values()])

    def _say_alive(self):
        with self.lock:
            for sock in list(self.ranks.values()):
                try:
                    _send(sock, ALIVE, SECONDS.pack(time.monotonic()))
                except OSError:  # that rank is gone: its close is read next
                    pass

    def _find_silent(self, now):
        """Stop the job once a rank still there gave no sign of life for as long as it said
        it may be silent (one not joined yet: as long as the first to join said)."""
        if self.failure is not None or not self.silence:
            return
        usual = next(iter(self.silence.values()))
        for rank, last in list(self.heard.items()):
            limit = self.silence.get(rank, usual)
            if rank not in self.left and now - last > limit:
                self.silent = rank
                self.abort(f"rank {rank} gave no sign of life for {limit:g} s (frozen, or "
                           "its host is gone)")
                return

    def _join(self, sock, payload):
        rank, world, per_node, silence = HELLO.unpack(payload)
        problem = None
        if world != self.world or per_node != self.ranks_per_node:
            problem = (f"rank {rank} expects {world} ranks, {per_node} per node; this job has "
                       f"{self.world}, {self.ranks_per_node} per node")
        elif rank >= self.world or rank in self.ranks:
            problem = f"rank {rank} joined twice, or is not in 0..{self.world - 1}"
        if problem:
            self.abort(problem)
        if self.failure is not None:
            with self.lock:
                _send(sock, ABORT, self.failure.encode())
            return None
        with self.lock:
            self.ranks[rank] = sock
            self.heard[rank], self.silence[rank] = time.monotonic(), silence
            sock.settimeout(silence)
            _send(sock, WELCOME, self.job.encode())
        return rank

    def _gather(self, rank, payload):
        self.gathered[rank] = payload
        if len(self.gathered) == self.world and self.failure is None:
            reply = _pack_list([self.gathered[r] for r in range(self.world)])
            self.gathered = {}
            with self.lock:
                for sock in self.ranks.values():
                    try:
                        _send(sock, GATHERED, reply)
                    except OSError:  # that rank is gone: its close is read next
                        pass

    def _late(self, rank, sock, timeout):
        """`rank` waited `timeout` s in a gather: name the ranks that have not come, to it
        and, stopping the job, to all. (A rank frozen just after its last sign of life is
        called silent only later; the gather's own words then name it first.) If the gather
        has completed since, its reply is on the way: nothing to say."""
        if rank not in self.gathered or self.failure is not None:
            return
        missing = sorted(set(range(self.world)) - set(self.gathered))
        why = f"no allgather from {_ranks(missing)} within {timeout:g} s"
        with self.lock:
            with contextlib.suppress(OSError):  # that rank is gone: its close is read next
                _send(sock, MISSING, why.encode())
        self.abort(why)


def _ranks(ranks, shown=4):
    """'rank 1', 'ranks 1, 3', 'ranks 1, 2, 3, 4 and 12 more'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    names = ", ".join(str(r) for r in ranks[:shown])
    return f"ranks {names}" + (f" and {len(ranks) - shown} more" if len(ranks) > shown else "")


# --- a rank's side ---------------------------------------------------------------

class Group:
    """This rank's view of the job: its Place, and the rendezvous to gather and barrier on.
    `timeout`: how long a gather may take; `silence` (default: that): how long a rank, or
    the rendezvous, may give no sign of life before it is taken for frozen."""

    def __init__(self, place, timeout=30.0, silence=None):
        self.place, self.timeout = place, timeout
        self.silence = timeout if silence is None else silence
        self.rank, self.world = place.rank, place.world
        self.node, self.nodes, self.gpu = place.node, place.nodes, place.gpu
        self.ranks_per_node = place.ranks_per_node
        self.server = self.sock = None
        self.next_check = 0.0
        self.lock = threading.Lock()  # our sends: the main thread's and the heartbeat's
        self.closing = threading.Event()
        if self.world == 1:
            self.job = secrets.token_hex(4)
            return
        if place.serve:
            try:
                self.server = RendezvousServer(place.world, place.ranks_per_node, "",
                                               place.rendezvous[1], join_timeout=timeout)
            except OSError as e:
                raise ValueError(f"cannot serve the rendezvous on port {place.rendezvous[1]} "
                                 f"(MASTER_PORT + 1): {e.strerror}") from None
        self.sock = self._connect(place.rendezvous, timeout)
        self.heard = time.monotonic()  # the rendezvous's last sign of life (_read)
        self.offset = math.inf  # our clock less its, at most (its beats carry its time)
        self._say(JOIN, HELLO.pack(place.rank, place.world, place.ranks_per_node,
                                   self.silence))
        kind, payload = self._reply(timeout, "a welcome from the rendezvous")
        self.job = payload.decode()
        threading.Thread(target=self._beat, daemon=True, name="rendezvous heartbeat").start()
        # Everyone is here before anyone starts; a missing rank is the server's to report.
        self.barrier(timeout + 5)

    @staticmethod
    def _connect(address, timeout):
        deadline = time.monotonic() + timeout
        while True:  # rank 0 may not be listening yet
            try:
                sock = socket.create_connection(address, timeout=timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return sock
            except OSError as e:
                if time.monotonic() > deadline:
                    raise PeerGone(f"no rendezvous at {address[0]}:{address[1]} within "
                                   f"{timeout:g} s ({e.strerror or e})") from None
                time.sleep(0.05)

    def _say(self, kind, payload=b""):
        with self.lock:
            if self.sock is not None:
                _send(self.sock, kind, payload)

    def _beat(self):
        """Say that this rank lives, until it closes: nothing else tells a frozen rank from
        a busy one."""
        while not self.closing.wait(min(ALIVE_EVERY, self.silence / 4)):
            try:
                self._say(ALIVE)
            except OSError:  # the rendezvous is gone: the main thread hears it
                return

    def _reply(self, timeout, what):
        """The next message from the server; an ABORT, a closed socket or silence raise."""
        deadline = time.monotonic() + timeout
        while True:
            readable, _, _ = select.select([self.sock], [], [], min(0.1, self.silence / 4))
            if readable:
                message = self._read()
                if message is not None:
                    return message
                continue  # every beat that waits is read before the silence is judged
            now = time.monotonic()
            if now - self.heard > self.silence:
                raise PeerGone(f"the rendezvous gave no sign of life for {self.silence:g} s "
                               "(its host, rank 0 or the launcher, is frozen or gone)")
            if now > deadline:
                raise TimeoutError(f"no {what} within {timeout:g} s")

    def _read(self):
        """One message from the server, None for a sign of life; an ABORT or a closed
        socket raise. A beat read late (this rank computed for seconds, not looking) was
        sent long before: it carries the server's clock, which our smallest difference to
        it yet (a transit's worth above the truth, never below) turns into ours. Taking the
        time it was read instead, a rank that computed for 5 s after the launcher froze
        waited 5 s more in its next barrier (scripts/chaos.py, chapter 19)."""
        try:
            kind, payload = _recv(self.sock)
        except (EOFError, OSError):
            raise PeerGone("the rendezvous closed (its host, rank 0 or the launcher, "
                           "is gone)") from None
        now = time.monotonic()
        if kind == ALIVE:
            sent = SECONDS.unpack(payload)[0]
            self.offset = min(self.offset, now - sent)
            self.heard = max(self.heard, sent + self.offset)
        else:  # an answer to what we asked: sent since
            self.heard = now
        if kind == ABORT:
            raise PeerGone(f"stopping: {payload.decode()}")
        return None if kind == ALIVE else (kind, payload)

    def allgather(self, payload, timeout=None):
        """Every rank's `payload` (bytes), in rank order."""
        if self.world == 1:
            return [payload]
        timeout = timeout or self.timeout
        self._say(GATHER, payload)
        try:
            kind, reply = self._reply(timeout, "allgather from every rank")
        except TimeoutError as late:
            # the rendezvous knows which ranks have not come: ask it, so the line names them
            self._say(LATE, SECONDS.pack(timeout))
            try:
                kind, reply = self._reply(LATE_ANSWER, "answer")
            except TimeoutError:
                raise late from None
            if kind == MISSING:
                raise TimeoutError(reply.decode()) from None
        return _unpack_list(reply)

    def barrier(self, timeout=None):
        self.allgather(b"", timeout)

    def check(self):
        """Raise PeerGone if the job was stopped (another rank is gone). Cheap: looks at
        the socket at most every CHECK_EVERY seconds; call it from every wait loop."""
        if self.sock is None:
            return
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_EVERY
        while select.select([self.sock], [], [], 0)[0]:
            self._read()  # only signs of life, an ABORT or a close come unasked

    def close(self):
        """Say goodbye (so that leaving is not mistaken for dying) and disconnect."""
        try:
            self._say(BYE)
        except OSError:
            pass
        self._disconnect()
        if self.server is not None:
            self.server.join(self.timeout)

    def _disconnect(self):
        self.closing.set()
        with self.lock:
            if self.sock is not None:
                self.sock.close()
                self.sock = None

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is None:
            self.close()
        else:  # failing: close without a goodbye, so others stop too
            self._disconnect()


# --- the launcher -----------------------------------------------------------------

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

"""The rendezvous: its messages, and the server that joins the ranks, gathers for them and
tells each that another is gone (common/launch/__init__.py tells the whole)."""
import contextlib
import secrets
import select
import socket
import struct
import threading
import time

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

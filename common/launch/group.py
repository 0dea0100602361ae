"""A rank's side of the rendezvous: its Group, to gather and barrier on, which stops with
PeerGone when another rank or the rendezvous is gone."""
import math
import secrets
import select
import socket
import threading
import time

from common.launch.rendezvous import (ABORT, ALIVE, ALIVE_EVERY, BYE, CHECK_EVERY, GATHER, HELLO,
                                      JOIN, LATE, LATE_ANSWER, MISSING, SECONDS, PeerGone,
                                      RendezvousServer, _recv, _send, _unpack_list)


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

"""The pending-operation queue of chapter 07, for the chapters after it.

A provider that is full answers -FI_EAGAIN. The operation then waits here, in
order, while the caller reads the CQ (which is what frees room and, on most
providers, moves the data); each read posts what waited, oldest first. The
WRITE messages it posts are built once (connect.write_messages); a post only sets
the context of the operation. A Connection is what the server holds for the client
it serves: the queue that talks to it, its heartbeats, its inbox and the backlog.
"""
import collections
import struct
import time

import common.fabric as fi
from common import bounds
from common.fabric import ffi, lib

WRITE, SEND = 1, 2               # what an operation in flight is
HEARTBEAT = struct.Struct("<Q")  # server -> client: WRITEs completed so far
BEAT_EVERY = 0.5                 # seconds between heartbeats


class OpQueue:
    """Operations handed to the provider, or waiting in order for room after -FI_EAGAIN.

    Each operation in flight owns one context from a free list; its completion
    gives the context back, so an operation completing twice (or never) shows.
    WRITEs are the bulk; a heartbeat SEND goes through the same queue and
    waits its turn like them.
    """

    def __init__(self, ep, cq, poller, slots):
        self.ep, self.cq, self.poller = ep, cq, poller
        self.contexts = ffi.new("struct fi_context2[]", slots)
        self.first, self.stride = fi.key(self.contexts), ffi.sizeof("struct fi_context2")
        self.context = [self.contexts + i for i in range(slots)]
        self.free = collections.deque(range(slots))  # oldest freed first: a stale
        # completion then finds its context idle, not reused
        self.busy = bytearray(slots)         # what that context is doing: 0, WRITE or SEND
        self.answered = bytearray(slots)     # its WRITE waits for the peer's answer
        self.pending = collections.deque()  # (kind, message, flags) not taken yet
        self.entries = fi.cq_entries(64)
        # Posts refused by the provider (-FI_EAGAIN), and posts held back because every
        # context of ours was in flight: two different queues full, counted apart.
        self.completed = self.eagain = self.full = self.sends = 0

    def write(self, msg, flags=lib.FI_COMPLETION):
        self.submit(WRITE, msg, flags)

    def send(self, msg):
        self.sends += 1
        self.submit(SEND, msg, lib.FI_COMPLETION)

    def submit(self, kind, msg, flags):
        """Post now, or queue behind the operations already waiting (order is kept)."""
        if self.pending or not self._post(kind, msg, flags):
            self.pending.append((kind, msg, flags))

    def _post(self, kind, msg, flags):
        if not self.free:  # every context in flight: wait for completions like for EAGAIN
            self.full += 1
            return False
        slot = self.free.popleft()
        msg.context = self.context[slot]
        rc = (lib.fi_writemsg if kind == WRITE else lib.fi_sendmsg)(self.ep, msg, flags)
        if rc == 0:
            self.busy[slot] = kind
            self.answered[slot] = bool(flags & lib.FI_DELIVERY_COMPLETE)
            return True
        self.free.append(slot)
        if rc == -lib.FI_EAGAIN:
            self.eagain += 1
            return False
        raise fi.FabricError("fi_writemsg" if kind == WRITE else "fi_sendmsg", rc)

    def progress(self):
        """Read completions (which is also what makes the provider move data), then post
        what waited. Returns the number of WRITEs completed by this call."""
        before = self.completed
        self._read()
        while self.pending and self._post(*self.pending[0]):
            self.pending.popleft()
        return self.completed - before

    def _read(self):
        """One read of the CQ, each completion matched to its context; returns how many
        entries it read."""
        n = self.poller.read(self.entries)
        for e in self.entries[0:n]:
            slot = (fi.key(e.op_context) - self.first) // self.stride
            if not 0 <= slot < len(self.busy):  # not ours: a receive, for the poller
                self.poller.keep(e)
                continue
            kind = self.busy[slot]
            if not kind:
                raise ValueError(f"a second completion for the operation of context {slot}")
            self.busy[slot] = 0
            self.free.append(slot)
            if kind == WRITE:
                self.completed += 1
            else:
                self.sends -= 1
        return n

    def next_message(self, inbox, timeout, what="its data"):
        """The next message in `inbox` (an fi.Inbox on this endpoint), reading the CQ
        through the queue meanwhile, so that WRITE completions are counted, not lost;
        `what` the client confirms, in a timeout's message."""
        late = f"the client did not confirm {what} within {timeout:g} s"
        with bounds.Deadline(timeout, late) as deadline:
            while fi.key(inbox.ctx) not in self.poller.done:
                if not self.progress() and time.monotonic() > deadline.at:
                    raise TimeoutError(late)
        return inbox.take(self.poller.done.pop(fi.key(inbox.ctx)))

    def in_flight(self):
        return len(self.busy) - len(self.free)

    def awaiting_answers(self):
        """Operations in flight that complete only when the peer answers (WRITEs with
        FI_DELIVERY_COMPLETE): while any is, the peer's address must stay where the
        provider's progress looks for it (connect.let_go)."""
        return sum(1 for slot, kind in enumerate(self.busy) if kind and self.answered[slot])

    def drain(self, timeout):
        """After a client's failure: wait (bounds.tidy) for what is in flight, then read the CQ
        until it is empty, so no completion of ours lands on the next client's queue, and no
        WRITE reads freed memory. Empty, not only idle: from libfabric 2.5 shm answers a WRITE
        whose copy into a gone peer fails with -FI_EAGAIN and, each time, an error entry
        without a context (smr_rma_fast, prov/shm/src/smr_rma.c), which no operation of ours
        would ever take off the CQ.

        Never after Ctrl-C (KeyboardInterrupt): it mostly lands just after fi_writemsg or
        fi_cq_read returns, where the call spends its time, before this queue has noted
        what the call did, so a drain would meet "a second completion" or wait in vain
        for completions already read. The process is ending then, and closing the
        endpoint discards what is still posted (man/fi_endpoint.3.md, fi_close)."""
        self.pending.clear()
        timeout = bounds.tidy(timeout)
        with bounds.Deadline(timeout, f"{self.in_flight()} operations in flight did not "
                             f"complete within {timeout:g} s") as deadline:
            self._drain(deadline)

    def abandon(self):
        """After a drain that left operations in flight (a stopped peer): their late ends,
        success or failure, are the poller's to drop (Poller.abandoned), and this queue,
        with the memory they read, must outlive them: returns how many."""
        out = {fi.key(self.context[slot]) for slot, kind in enumerate(self.busy) if kind}
        self.poller.abandoned |= out
        return len(out)

    def _drain(self, deadline):
        while time.monotonic() < deadline.at:
            try:
                if not self._read() and not self.in_flight():
                    return
            except fi.CompletionError as e:  # a failed operation gives its context back too
                slot = (fi.key(e.context) - self.first) // self.stride
                if 0 <= slot < len(self.busy) and self.busy[slot]:
                    self.busy[slot] = 0
                    self.free.append(slot)


class Connection:
    """The server's line to the client it serves: the client's address, the op queue of our
    endpoint that talks to it, the inbox its messages land in, the backlog where the
    CONNECTs of other clients wait meanwhile (served next), how long it may be silent
    (timeout), and what is opened for it (own, on our endpoint's domain).

    Every BEAT_EVERY seconds a heartbeat SEND tells the client how many WRITEs have
    completed (beat). Without it the client, whose CPU sees nothing of one-sided WRITEs,
    could not tell a long run from a dead server. One beat at a time: its buffer is in
    use until the SEND completes.
    """

    def __init__(self, own, domain, client, queue, inbox, backlog, timeout):
        self.own, self.domain, self.client, self.queue = own, domain, client, queue
        self.inbox, self.backlog, self.timeout, self.last = inbox, backlog, timeout, 0.0
        self.buf = ffi.new("char[]", HEARTBEAT.size)
        mr = own(fi.mr_reg(domain, self.buf, HEARTBEAT.size, lib.FI_SEND, key=2001))
        self.msg, self.pieces = fi.msg(self.buf, HEARTBEAT.size, fi.mr_desc(mr), client, ffi.NULL)

    def beat(self, completed):
        """Queue a heartbeat saying `completed`, if one is due; True if it was."""
        now = time.perf_counter()
        if now - self.last < BEAT_EVERY or self.queue.sends:
            return False
        self.buf[0:HEARTBEAT.size] = HEARTBEAT.pack(completed)
        self.queue.send(self.msg)
        self.last = now
        return True

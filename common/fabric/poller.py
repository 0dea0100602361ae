"""Waiting for completions: Poller keeps each by operation context until it is asked for;
connreq_pending, the grace a shm client before libfabric 2.0 gives its connection request."""
import os
import time

from common import bounds
from common.fabric import binding
from common.fabric.binding import API_VERSION, ffi, lib
from common.fabric.calls import cq_entries, cq_read, getname, key, mr_desc, mr_reg, sendmsg
from common.fabric.errors import CompletionError
from common.fabric.fi_info import SHM_PREFIX

CONNREQ_CHECKED = 2 << 16  # the API version from which shm checks that it mapped a requester
CONNREQ_GRACE = 2.0  # seconds a client about to give up leaves its connection request to be read


def connreq_pending(ep, post, poll):
    """Before a client gives up on a post that met -FI_EAGAIN: on shm before libfabric 2.0,
    keep calling `post` (and `poll`) until the provider takes it, for CONNREQ_GRACE
    seconds at most; True if it did. Such a first post to a peer leaves it a connection
    request naming our region and returns -FI_EAGAIN until the peer has mapped us
    (smr_verify_peer, prov/shm/src/smr_ep.c). A peer that reads the request after our
    region is gone fails to map it and, before 2.0, goes on through the NULL region and
    dies (smr_progress_connreq, prov/shm/src/smr_progress.c: 2.0 checks the map). A post
    taken says that the peer has mapped us: the region is then safe to remove."""
    if API_VERSION >= CONNREQ_CHECKED or not getname(ep).startswith(SHM_PREFIX):
        return False
    grace = bounds.stretched(CONNREQ_GRACE)
    with bounds.Deadline(grace, f"the peer did not read our connection request within "
                         f"{grace:g} s") as deadline:
        while time.monotonic() < deadline.at:
            if post():
                return True
            poll()
    return False


IDLE_NAP = (50e-6, 4e-3)  # seconds: an idle wait's first sleep, and its longest
OWN_LOCK_BOUND = 1.0  # seconds our region's lock may stay held in an idle wait (1.x shm)


class EndpointDeaf(TimeoutError):
    """Our endpoint can serve no one: a CQ read would hang or crash (OwnLockHeld,
    RequesterGone). A server opens a new endpoint at the same address (a new region)."""


class OwnLockHeld(EndpointDeaf):
    """Our endpoint's shm region has stayed locked past OWN_LOCK_BOUND while we waited, idle,
    by a peer killed or stopped in a post to us: no CQ read of this endpoint can return
    until that peer is continued (OwnLock)."""


class RequesterGone(EndpointDeaf):
    """A connection request waiting in our shm region names a client region that is gone:
    libfabric 1.17's next CQ read would crash on it (peer_lock.h, tut_own_requester_gone)."""


def check_requesters(ep):
    """RequesterGone where reading `ep`'s CQ now would crash (1.17's shm; never elsewhere)."""
    if lib.tut_own_requester_gone(ep):
        raise RequesterGone("a client's connection request names a shm region that is gone "
                            "(it ended before we read it; libfabric 1.17 would crash reading "
                            "it, smr_progress_connreq)")


class OwnLock:
    """Before libfabric 1.18, shm's progress in fi_cq_read takes our own region's spin lock,
    which a peer takes to put a command in our region, and spins until it is free
    (peer_lock.h, tut_own_lock_held). A server's wait without a deadline (for its next
    client: Poller given its endpoint) looks at it before each read: held, it does not
    read (a live peer frees it within microseconds), and held for OWN_LOCK_BOUND its
    holder is taken as dead or stopped (OwnLockHeld): the server then opens its endpoint
    again at the same address (at_address), a new region, and serves the next client.
    Nothing to see on other providers and versions."""

    def __init__(self, ep):
        self.ep, self.since = ep, None
        self.bound = bounds.stretched(OWN_LOCK_BOUND)

    def held(self):
        """Whether the lock is held now (then do not read the CQ); OwnLockHeld once it has
        been held, at every look, for the bound; RequesterGone where a read would crash."""
        check_requesters(self.ep)
        if not lib.tut_own_lock_held(self.ep):
            self.since = None
            return False
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif now - self.since > self.bound:
            raise OwnLockHeld(f"our endpoint's shm region has been locked for {self.bound:g} s "
                              "by a client killed or stopped while it posted to us (libfabric "
                              "< 1.18)")
        return True




class Poller:
    """Reads a CQ and keeps each completion, by operation context, until it is asked for.

    With several operations in flight, completions come in any order; waiting
    for one must not lose the others. Immediate data from a peer's WRITE
    (FI_REMOTE_CQ_DATA) is kept apart, in arrival order.
    """

    def __init__(self, cq, batch=16, ep=None):
        self.cq, self.entries, self.ep = cq, cq_entries(batch), ep  # ep: OwnLock's
        self.done, self.remote_data = {}, []
        self.abandoned = set()  # operations settle() gave up on: their late ends are dropped

    def poll(self):
        n = self.read(self.entries)
        for e in self.entries[0:n]:
            self.keep(e)
        return n

    def read(self, entries):
        """One fi_cq_read of our CQ into `entries` (also for readers of the same CQ, such as
        an OpQueue), dropping the failure of an operation given up on: a late end, not the
        failure of whoever reads now."""
        if self.ep is not None:  # a server's poller: never a read that would crash
            check_requesters(self.ep)
        while True:
            try:
                return cq_read(self.cq, entries)
            except CompletionError as e:
                if key(e.context) not in self.abandoned:
                    raise
                self.abandoned.discard(key(e.context))

    def keep(self, entry):
        """File one completion away (also for readers of the same CQ that met one not theirs);
        the late end of an operation given up on is dropped."""
        if entry.op_context != ffi.NULL and key(entry.op_context) in self.abandoned:
            self.abandoned.discard(key(entry.op_context))
            return
        if entry.flags & lib.FI_REMOTE_CQ_DATA:  # test the flag: tcp reports len 0 here
            self.remote_data.append(entry.data)
        if entry.op_context != ffi.NULL:
            self.done[key(entry.op_context)] = entry.len

    def _until(self, ready, timeout, what, idle=False):
        if bounds.signalled() and binding._interrupting:  # its KeyboardInterrupt was taken for a
            raise KeyboardInterrupt               # client's failure: it still ends the run
        with bounds.armed(timeout, lambda: f"no {what} within {timeout:g} s"):
            self._wait(ready, timeout, what, idle)

    def _wait(self, ready, timeout, what, idle):
        deadline = None if timeout is None else time.monotonic() + timeout
        own_lock = OwnLock(self.ep) if timeout is None and self.ep is not None else None
        nap = 0.0
        while not ready():
            if self._read(own_lock):
                nap = 0.0
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:g} s")
            if idle:  # nobody to serve: sleep longer each time, the CPU is someone else's
                nap = min(max(2 * nap, IDLE_NAP[0]), IDLE_NAP[1])
                time.sleep(nap)
            else:
                # Let a peer on the same core run. Not time.sleep(0): that is a real
                # sleep (~50 us of timer slack), which cut tcp's throughput by 5x here.
                os.sched_yield()

    def _read(self, own_lock):
        """poll(), unless `own_lock` (an OwnLock, for a wait without a deadline) says our
        region is locked. Such a wait has no deadline, but each read there does: the lock
        taken by a peer killed in the instant between our look and our progress's is the
        watchdog's to end (one line, exit 1), not a hang."""
        if own_lock is None:
            return self.poll()
        if own_lock.held():
            return 0
        with bounds.Deadline(own_lock.bound, "a CQ read did not return: our shm region is locked "
                             "by a client killed or stopped while it posted to us"):
            return self.poll()

    def until_posted(self, post, timeout, what, ep=None):
        """Call `post` until the provider takes the operation (it returns False on
        -FI_EAGAIN: queue full, or tcp still connecting), polling for progress meanwhile.
        `ep`, the endpoint `post` posts on: late, it may still be kept a while
        (connreq_pending)."""
        late = f"no {what} within {timeout:g} s: is the peer running?"
        with bounds.Deadline(timeout, late) as deadline:
            while not post():
                self.poll()
                if time.monotonic() > deadline.at:
                    if ep is None or not connreq_pending(ep, post, self.poll):
                        raise TimeoutError(late)
                    return  # taken after all, once the peer had mapped us

    def send(self, own, domain, ep, data, dest, key, timeout, what, hint=""):
        """SEND the bytes `data` from a buffer registered for it (with requested `key`),
        and wait for its completion; `what` names it in a timeout's message."""
        buf = ffi.new("char[]", data)
        mr = own(mr_reg(domain, buf, len(data), lib.FI_SEND, key=key))
        ctx = ffi.new("struct fi_context2 *")
        self.until_posted(lambda: sendmsg(ep, buf, len(data), mr_desc(mr), dest, ctx), timeout,
                          f"{what} accepted", ep)
        self.wait([ctx], timeout, f"{what} completion{hint}")

    def wait(self, contexts, timeout, what, or_remote_data=False, idle=False):
        """Wait until one of `contexts` completes: returns (the first of them to complete,
        bytes received): messages are handled in the order they came.
        With `or_remote_data`, immediate data arriving first ends the wait: (None, 0).
        `idle`: a server waiting for its next client, which backs off instead of taking
        a core (a blocking wait is no way out on every libfabric: EFA's CQs take a wait
        object from 2.3 on efa-direct and 2.5 on efa, common/fabric/rules.h tut_rules_wait).
        Without a deadline (`timeout` None), a Poller given its endpoint raises OwnLockHeld
        where a dead client's lock would hang the wait."""
        self._until(lambda: any(key(c) in self.done for c in contexts)
                    or (or_remote_data and self.remote_data), timeout, what, idle)
        ctx = next((c for k in self.done for c in contexts if key(c) == k), None)
        return (None, 0) if ctx is None else (ctx, self.done.pop(key(ctx)))

    def wait_all(self, contexts, timeout, what):
        """Wait until every one of `contexts` has completed."""
        self._until(lambda: all(key(c) in self.done for c in contexts), timeout, what)
        for c in contexts:
            del self.done[key(c)]

    def settle(self, contexts, timeout):
        """After a peer's failure: read the CQ until each of `contexts` (operations posted to
        it) has completed or failed and the CQ is empty, for at most bounds.tidy(timeout), so
        that no entry of theirs fails a later wait for someone else and no operation reads
        memory freed after this; False where some had not ended by then: the endpoint still
        holds them, and their memory and contexts must outlive it (their late ends, success
        or error, are dropped by poll: `abandoned`). Errors are expected here: each is the
        peer's failure again, or, from libfabric 2.5, shm's entry without a context for a
        copy into a gone peer (smr_rma_fast, prov/shm/src/smr_rma.c)."""
        pending = {key(c) for c in contexts}
        timeout = bounds.tidy(timeout)
        # armed as OpQueue.drain is: a provider call that spins on a dead peer's lock (1.17's
        # shm) is the watchdog's to end, not a hang
        with bounds.Deadline(timeout, f"operations to a failed peer did not end within "
                             f"{timeout:g} s") as deadline:
            while time.monotonic() < deadline.at:
                try:
                    if not self.poll() and not pending - self.done.keys():
                        break
                except CompletionError as e:
                    pending.discard(key(e.context))
                except EndpointDeaf:  # no read can end them: the server renews the endpoint
                    break
        left = pending - self.done.keys()
        for k in pending:
            self.done.pop(k, None)
        self.abandoned |= left
        return not left

    def wait_remote_data(self, timeout, what):
        """The immediate data of the next WRITE that carried some."""
        self._until(lambda: self.remote_data, timeout, what)
        return self.remote_data.pop(0)

"""The C worker loops of chapters 11-15 on a fake provider: posting order, each WRITE
completed once, the final WRITE, batching, -FI_EAGAIN, bad completions, errors, *stop.

fi_writemsg and fi_cq_read are static inline in libfabric's headers: they call through
the endpoint's and the CQ's tables of functions. The fake fills those tables, so a
chapter's worker() runs unchanged on an endpoint and a CQ that follow a script (how many
WRITEs fit in flight, how many complete per CQ read, what goes wrong when) and log every
call. The fake is plain C, compiled with the C compiler and loaded with ffi.dlopen: cffi's
own compile step needs setuptools, which a virtualenv of Python 3.12+ does not have.
"""
import importlib
import os
import subprocess
from itertools import groupby
from types import SimpleNamespace

import pytest
from cffi import FFI

import common.fabric as fi
from common.engine import workers
from common.fabric._build import _flags

# What Python sees of the fake; compiled ahead of its C too, so it is written once.
DECLS = r"""
struct fid_ep;
struct fid_cq;
enum fake_fault { FAKE_NONE, FAKE_READ_ERROR, FAKE_POST_ERROR, FAKE_BOGUS, FAKE_TWICE };
struct fake_post {           /* one fi_writemsg call */
    uint64_t seq;            /* when: one count over the calls of every fake */
    size_t msg;              /* which of the lane's messages */
    uint64_t flags, data;
    uint64_t reads;          /* CQ reads before it */
    size_t in_flight;        /* WRITEs in flight before it */
    int64_t rc;              /* what it returned */
};
struct fake_read {           /* one fi_cq_read call */
    uint64_t seq;
    size_t in_flight;        /* WRITEs in flight before it */
    int64_t rc;              /* completions returned, or < 0 */
};
struct fake {
    struct fid_ep *ep;       /* what the worker's lane points at */
    struct fid_cq *cq;
    /* the script */
    size_t capacity;         /* WRITEs in flight before fi_writemsg says -FI_EAGAIN */
    const uint8_t *refuse;   /* and call n says it anyway if refuse[n % nrefuse] */
    size_t nrefuse;          /* (0: none) */
    const unsigned *pattern; /* CQ read r completes up to pattern[r % npattern] WRITEs */
    size_t npattern;
    int newest_first;        /* else the oldest WRITE in flight completes first */
    int fault;               /* enum fake_fault: CQ read (or fi_writemsg call) fault_at, */
    uint64_t fault_at;       /* counted from 0, goes wrong */
    int64_t error;           /* returned by FAKE_READ_ERROR and FAKE_POST_ERROR */
    void *bogus;             /* the context FAKE_BOGUS adds a completion for */
    int *stop;               /* set by the stop_after-th fi_writemsg call (0: never) */
    uint64_t stop_after;
    const void *msgs;        /* the lane's messages: a posted message -> its index */
    int rdma_core;           /* 1: efa-direct's rdma-core path (FI_EFA_USE_DATA_PATH_DIRECT=0) */
    /* what happened: log_cap calls each, then they fail with -FI_ENOMEM (a runaway loop) */
    struct fake_post *posts;
    struct fake_read *reads;
    size_t nposts, nreads, log_cap;
    void **in_flight;        /* contexts of the WRITEs in flight, oldest first */
    size_t nin_flight;
    uint64_t completed;
    uint64_t reused;         /* contexts posted again while their WRITE was in flight */
    size_t held;             /* rdma_core: the newest in flight, posted with FI_MORE, no doorbell */
    uint64_t lost;           /* rdma_core: WRITEs accepted with 0, then rolled back */
};
struct fake *fake_new(size_t log_cap);
void fake_free(struct fake *f);
"""

SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
""" + DECLS + r"""
static uint64_t calls;

static ssize_t fake_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags)
{
    struct fake *f = ep->fid.context;
    if (f->nposts == f->log_cap)
        return -FI_ENOMEM;
    struct fake_post *p = &f->posts[f->nposts++];
    *p = (struct fake_post){ .seq = ++calls, .msg = msg - (const struct fi_msg_rma *)f->msgs,
                             .flags = flags, .data = msg->data, .reads = f->nreads,
                             .in_flight = f->nin_flight };
    /* rdma_core: as efa_ibv_post_write (prov/efa/src/efa_data_path_ops.h) drives rdma-core,
       a WRITE with FI_MORE is only added to the open work-request session and returns 0;
       room is checked at the closing post (ibv_wr_complete), whose refusal rolls the
       whole session back: the WRITEs that went with FI_MORE are gone. */
    int queued = f->rdma_core && (flags & FI_MORE);
    if (f->fault == FAKE_POST_ERROR && f->nposts - 1 == f->fault_at) {
        p->rc = f->error;
    } else if (!queued && (f->nin_flight >= f->capacity
               || (f->nrefuse && f->refuse[(f->nposts - 1) % f->nrefuse]))) {
        p->rc = -FI_EAGAIN;
        f->lost += f->held;
        f->nin_flight -= f->held;
        f->held = 0;
    } else {
        for (size_t i = 0; i < f->nin_flight; i++)
            f->reused += f->in_flight[i] == msg->context;
        f->in_flight[f->nin_flight++] = msg->context;
        f->held = queued ? f->held + 1 : 0;
    }
    if (f->nposts == f->stop_after)
        *f->stop = 1;
    return p->rc;
}

/* The completions of CQ read number n, as the script says. */
static ssize_t complete(struct fake *f, uint64_t n, struct fi_cq_data_entry *e, size_t count)
{
    if (f->fault == FAKE_READ_ERROR && n == f->fault_at)
        return f->error;
    size_t k = f->pattern[n % f->npattern], rung = f->nin_flight - f->held;
    if (k > count)
        k = count;
    if (k > rung)  /* the device has not seen those held without a doorbell */
        k = rung;
    for (size_t i = 0; i < k; i++) {
        size_t at = f->newest_first ? f->nin_flight - f->held - 1 : 0;
        e[i] = (struct fi_cq_data_entry){ .op_context = f->in_flight[at] };
        f->nin_flight--;
        memmove(&f->in_flight[at], &f->in_flight[at + 1], (f->nin_flight - at) * sizeof(void *));
    }
    f->completed += k;
    if (n == f->fault_at && k < count) {
        if (f->fault == FAKE_BOGUS)
            e[k++] = (struct fi_cq_data_entry){ .op_context = f->bogus };
        else if (f->fault == FAKE_TWICE && k) {
            e[k] = e[k - 1];
            k++;
        }
    }
    return k ? (ssize_t)k : -FI_EAGAIN;
}

static ssize_t fake_cq_read(struct fid_cq *cq, void *buf, size_t count)
{
    struct fake *f = cq->fid.context;
    if (f->nreads == f->log_cap)
        return -FI_ENOMEM;
    struct fake_read *r = &f->reads[f->nreads];
    *r = (struct fake_read){ .seq = ++calls, .in_flight = f->nin_flight };
    r->rc = complete(f, f->nreads, buf, count);
    f->nreads++;
    return r->rc;
}

static struct fi_ops_rma rma = { .size = sizeof rma, .writemsg = fake_writemsg };
static struct fi_ops_cq cq_ops = { .size = sizeof cq_ops, .read = fake_cq_read };

struct fake *fake_new(size_t log_cap)
{
    struct fake *f = calloc(1, sizeof *f);
    f->ep = calloc(1, sizeof *f->ep);
    f->cq = calloc(1, sizeof *f->cq);
    f->ep->fid.context = f->cq->fid.context = f;
    f->ep->rma = &rma;
    f->cq->ops = &cq_ops;
    f->capacity = SIZE_MAX;
    f->log_cap = log_cap;
    f->posts = calloc(log_cap, sizeof *f->posts);
    f->reads = calloc(log_cap, sizeof *f->reads);
    f->in_flight = calloc(log_cap, sizeof *f->in_flight);
    return f;
}

void fake_free(struct fake *f)
{
    free(f->ep);
    free(f->cq);
    free(f->posts);
    free(f->reads);
    free(f->in_flight);
    free(f);
}
"""

CHAPTERS = [11, 12, 13, 14, 15]
UNLIMITED = 2**64 - 1  # capacity: fi_writemsg never says -FI_EAGAIN
TX_SIZE = 4            # lane_array gives each lane 4 * TX_SIZE + 64 = 80 contexts
NMSGS = 7              # fewer messages than WRITEs: they are posted round robin
LOG = 1 << 16
EAGAIN = -fi.lib.FI_EAGAIN
FINAL = fi.lib.FI_COMPLETION | fi.lib.FI_REMOTE_CQ_DATA


@pytest.fixture(scope="session")
def fake(tmp_path_factory):
    """(ffi, lib) of the fake, built against the libfabric headers the chapters were."""
    where = tmp_path_factory.mktemp("fake_provider")
    (where / "fake.c").write_text(SOURCE)
    includes = [f"-I{d}" for d in _flags()["include_dirs"]]
    cc = subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O2", *includes,
                         "-o", str(where / "fake.so"), str(where / "fake.c")],
                        capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    ffi = FFI()
    ffi.cdef(DECLS)
    return SimpleNamespace(ffi=ffi, lib=ffi.dlopen(str(where / "fake.so")))


def address(pointer):
    """Pointers cross between the fake's FFI and the chapters' as integers."""
    return int(fi.ffi.cast("uintptr_t", pointer))


class Lane:
    """One NIC: a fake endpoint and CQ, with its WRITE messages."""

    def __init__(self, fake, iters, capacity=UNLIMITED, pattern=(1,), refuse=(), **script):
        self.iters = iters
        self.fake = fake.ffi.gc(fake.lib.fake_new(LOG), fake.lib.fake_free)
        self.pattern = fake.ffi.new("unsigned[]", pattern)
        self.refuse = fake.ffi.new("uint8_t[]", refuse)
        self.messages = fi.ffi.new("struct fi_msg_rma[]", NMSGS)
        f = self.fake
        f.capacity, f.pattern, f.npattern = capacity, self.pattern, len(pattern)
        f.refuse, f.nrefuse = self.refuse, len(refuse)
        f.msgs = fake.ffi.cast("void *", address(self.messages))
        for name, value in script.items():
            setattr(f, name, value)

    def stand_in(self, native):
        """What workers.lane_array reads of a common.engine.multinet Lane."""
        return SimpleNamespace(
            info=SimpleNamespace(tx_attr=SimpleNamespace(size=TX_SIZE)), iters=self.iters,
            ep=native.ffi.cast("struct fid_ep *", address(self.fake.ep)),
            cq=native.ffi.cast("struct fid_cq *", address(self.fake.cq)),
            messages=[self.messages + i for i in range(NMSGS)])

    def posts(self):
        return list(self.fake.posts[0:self.fake.nposts])

    def reads(self):
        return list(self.fake.reads[0:self.fake.nreads])

    def accepted(self):
        return [p for p in self.posts() if p.rc == 0]


class Worker:
    """One chapter's worker() on fake lanes, called as common/workers.call calls it."""

    def __init__(self, fake, chapter, lanes):
        self.native = importlib.import_module(f"common._native{chapter}")
        self.chapter, self.lanes = chapter, lanes
        ffi = self.native.ffi
        self.stop, self.failed = ffi.new("int *"), ffi.new("int *")
        for lane in lanes:
            lane.fake.stop = fake.ffi.cast("int *", address(self.stop))
        self.array, self.keep = workers.lane_array(self.native,
                                                   [lane.stand_in(self.native) for lane in lanes])
        # 11 and 12 add to a shared total, 13+ to a counter of their own
        self.count = ffi.new("uint64_t *" if chapter <= 12 else "struct counter *")

    def run(self, batch=16):
        # 11-13 take no batch; 14 also takes its FI_MORE (chapters/14_batch.py more_flag)
        before = (() if self.chapter <= 13 else (batch, fi.lib.FI_MORE) if self.chapter == 14
                  else (batch,))
        return self.native.lib.worker(self.array, len(self.lanes), *before, self.count,
                                      self.stop, self.failed)

    def done(self):
        return self.count[0] if self.chapter <= 12 else self.count.value


def run(fake, chapter, lanes, batch=16):
    worker = Worker(fake, chapter, lanes)
    return worker, worker.run(batch)


REFUSALS = {
    # room for 3 WRITEs, and reads that complete 0, 0, 2, 0, 0, 2, ...: slower than even
    # one WRITE per visit, so the provider is full and reads are empty all along
    "full": dict(capacity=3, pattern=(0, 0, 2)),
    # two calls in every three refused, with room or not (shm's bounce buffers, tcp's
    # queue): room comes back without a completion
    "transient": dict(refuse=(0, 1, 1), pattern=(0, 1)),
}


@pytest.mark.parametrize("newest_first", [0, 1], ids=["oldest-first", "newest-first"])
@pytest.mark.parametrize("refusals", REFUSALS)
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_writes_posted_in_order_each_completed_once(fake, chapter, refusals, newest_first):
    # The lanes: more WRITEs than contexts and room in the pending ring (80: both wrap
    # around), only the final one, none.
    lanes = [Lane(fake, iters, newest_first=newest_first, **REFUSALS[refusals])
             for iters in (300, 1, 0)]
    worker, rc = run(fake, chapter, lanes)
    assert rc == 0
    assert worker.done() == 301
    for lane, w in zip(lanes, worker.array):
        assert w.completed == w.submitted == lane.iters
        assert lane.fake.completed == lane.iters and lane.fake.nin_flight == 0
        assert lane.fake.reused == 0
        accepted = lane.accepted()
        assert [p.msg for p in accepted] == [i % NMSGS for i in range(lane.iters)]
        assert all(p.rc in (0, EAGAIN) for p in lane.posts())
        # chapter 14 rings one doorbell a visit: FI_MORE on all of its WRITEs but the last
        more = fi.lib.FI_MORE if chapter == 14 else 0
        assert all(p.flags & ~more == fi.lib.FI_COMPLETION for p in accepted[:-1])
        if more and lane.iters > 1:
            assert any(p.flags & more for p in accepted)
    assert not lanes[2].posts() and not lanes[2].reads()
    for lane in lanes[:2]:
        final = lane.accepted()[-1]
        assert final.flags == FINAL and final.data == lane.iters
        assert final.in_flight == 0  # all the others had completed
    assert any(p.rc == EAGAIN for p in lanes[0].posts())


@pytest.mark.parametrize("chapter,batch", [(11, 1), (12, 1), (13, 1), (14, 1), (14, 4),
                                           (14, 16), (15, 1), (15, 4), (15, 16)])
def test_new_writes_between_cq_reads_at_most_batch(fake, chapter, batch):
    # 11-13 post one new WRITE per visit (their batch is 1), 14 and 15 up to `batch`;
    # a visit reads the CQ once. The provider takes all, and a read completes one.
    lanes = [Lane(fake, 500) for _ in range(2)]
    _, rc = run(fake, chapter, lanes, batch)
    assert rc == 0
    for lane in lanes:
        per_read = [len(list(posts)) for _, posts in groupby(lane.posts(), lambda p: p.reads)]
        assert max(per_read) == batch


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_eagain_counted_per_lane(fake, chapter):
    lanes = [Lane(fake, 200, capacity=c, pattern=(0, 0, 1)) for c in (2, 4)]
    worker, rc = run(fake, chapter, lanes, batch=4)
    assert rc == 0
    for lane, w in zip(lanes, worker.array):
        refused = sum(p.rc == EAGAIN for p in lane.posts())
        assert w.eagain == refused
        # 15 posts only as many as completed (the room they left): once full, never refused
        assert refused > 0 if chapter < 15 else refused <= 1


def eagain_and_reads(fake, chapter):
    """(refused fi_writemsg calls, CQ reads that gave room) of a lane posting 16 at a time
    into room for 4, with one completion every third read."""
    lane = Lane(fake, 300, capacity=4, pattern=(0, 0, 1))
    worker, rc = run(fake, chapter, [lane, Lane(fake, 300, capacity=4, pattern=(0, 0, 1))])
    assert rc == 0
    return worker.array[0].eagain, sum(r.rc > 0 for r in lane.reads())


def test_lazy_posting_is_refused_less_than_eager_posting(fake):
    eagain14, _ = eagain_and_reads(fake, 14)
    eagain15, gave_room = eagain_and_reads(fake, 15)
    assert eagain15 < eagain14
    # 15 posts after a read that gave completions back, as many as came back (or with
    # nothing in flight, filling up until the first refusal)
    assert eagain15 <= min(1, gave_room)


@pytest.mark.parametrize("chapter,posts_after_empty_read", [(14, True), (15, False)])
def test_only_eager_posting_calls_writemsg_after_an_empty_cq_read(fake, chapter,
                                                                 posts_after_empty_read):
    lanes = [Lane(fake, 200, capacity=3, pattern=(0, 0, 1)) for _ in range(2)]
    _, rc = run(fake, chapter, lanes, batch=4)
    assert rc == 0
    for lane in lanes:
        reads = lane.reads()
        empty = [r.rc == EAGAIN and r.in_flight > 0 for r in reads]  # nothing came back
        assert any(empty)
        after_empty = [p for p in lane.posts() if p.reads and empty[p.reads - 1]]
        assert bool(after_empty) == posts_after_empty_read


BAD_COMPLETIONS = {
    # completions for a context, made from the lane's struct lane `w`
    "before-the-contexts": lambda w: w.contexts - 1,
    "past-the-contexts": lambda w: w.contexts + w.nslots,
    # at most 2 in flight, taken from the top of the free stack: slot 0 stays idle
    "an-idle-context": lambda w: w.contexts,
}


@pytest.mark.parametrize("bad", [*BAD_COMPLETIONS, "the-same-context-twice"])
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_completion_for_no_write_in_flight_fails(fake, chapter, bad):
    lanes = [Lane(fake, 100, capacity=2) for _ in range(3)]
    worker = Worker(fake, chapter, lanes)
    w, f = worker.array[1], lanes[1].fake
    # `busy` with one more byte, saying busy: a bound check off by one would read it and
    # take a completion for the context just past the end
    guarded = worker.native.ffi.new("uint8_t[]", w.nslots + 1)
    guarded[w.nslots] = 1
    w.busy = guarded
    f.fault_at = 5
    if bad in BAD_COMPLETIONS:
        f.fault = fake.lib.FAKE_BOGUS
        f.bogus = fake.ffi.cast("void *", address(BAD_COMPLETIONS[bad](w)))
    else:
        f.fault = fake.lib.FAKE_TWICE
    assert worker.run() == -fi.lib.FI_EOTHER
    assert worker.failed[0] == 1
    assert f.nreads == 6  # it stopped at the bad completion


@pytest.mark.parametrize("fault,at,error,refuse,write", [
    ("FAKE_READ_ERROR", 4, -fi.lib.FI_EAVAIL, (), None),
    ("FAKE_POST_ERROR", 3, -fi.lib.FI_EINVAL, (), 3),
    ("FAKE_POST_ERROR", 4, -fi.lib.FI_EINVAL, (0, 0, 0, 1), 3),  # call 3 was refused
    ("FAKE_POST_ERROR", 9, -fi.lib.FI_EINVAL, (), 9),  # the final one, with immediate data
], ids=["cq-read", "writemsg", "retried-writemsg", "final-writemsg"])
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_error_returned_with_its_lane(fake, chapter, fault, at, error, refuse, write):
    lanes = [Lane(fake, 10), Lane(fake, 10), Lane(fake, 10, refuse=refuse)]
    f = lanes[2].fake
    f.fault, f.fault_at, f.error = getattr(fake.lib, fault), at, error
    worker, rc = run(fake, chapter, lanes)
    assert rc == error
    assert worker.failed[0] == 2
    if write is not None:  # the failing call is the one meant: it posts WRITE `write`
        assert lanes[2].posts()[-1].msg == write % NMSGS
        assert (lanes[2].posts()[-1].flags == FINAL) == (write == 9)


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_stop_returns_promptly(fake, chapter):
    # The first lane's 50th fi_writemsg sets *stop. Had the worker ignored it, it would run
    # until the fake's log is full, and fail.
    lanes = [Lane(fake, 10**6, capacity=4, stop_after=50), Lane(fake, 10**6, capacity=4),
             Lane(fake, 10**6, capacity=4)]
    worker, rc = run(fake, chapter, lanes)
    assert rc == 0
    stopped = lanes[0].posts()[49].seq
    for lane, w in zip(lanes, worker.array):
        assert w.completed < lane.iters
        assert sum(r.seq > stopped for r in lane.reads()) <= 1  # the round in progress


@pytest.mark.parametrize("pattern", [(1,), (0, 0, 2)], ids=["steady", "slow"])
def test_14_loses_no_batch_on_efa_directs_rdma_core_path(fake, pattern):
    """Issue 46, 6: on efa-direct's rdma-core path a too long FI_MORE batch vanishes at its
    closing post. The send queue holds tx_attr.size (TX_SIZE) WRITEs; chapter 14 batches
    only as many as there is room for, so every WRITE accepted completes."""
    lanes = [Lane(fake, 300, capacity=TX_SIZE, pattern=pattern, rdma_core=1),
             Lane(fake, 300, capacity=TX_SIZE, pattern=pattern, rdma_core=1, newest_first=1)]
    worker, rc = run(fake, 14, lanes)
    assert [lane.fake.lost for lane in lanes] == [0, 0]
    assert rc == 0 and worker.done() == 600
    assert all(any(p.flags & fi.lib.FI_MORE for p in lane.accepted()) for lane in lanes)

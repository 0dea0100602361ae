/* cdef
struct counter {            // one worker's count of completed WRITEs, alone on its cache
    uint8_t before[64];     // line: the padding keeps every other variable off that line
    uint64_t value;
    uint8_t after[56];
};
int worker(struct lane *lanes, size_t nlanes, unsigned batch, struct counter *done,
           int *stop, int *failed_lane);
*/
/* Chapter 15's worker: chapter 14's, posting lazily.
 *
 * In chapter 14 a new WRITE is posted as soon as it is submitted, and the
 * pending ring is retried on every visit: when the provider is full, each of
 * those posts is a call that fails with -FI_EAGAIN, and the failures pile up
 * (12.7 million for 400,000 WRITEs of 1 MiB: shm with CUDA IPC, libfabric
 * 2.1.0, a 2 x H200 box, 2026-11-30). Now submitting only puts the WRITE
 * in the ring, and the ring is posted only after reading the CQ gave
 * completions back: as many WRITEs as completed, the room they left where a
 * completion means room. There (same box) the posts that are made are the
 * ones that succeed: 0 refusals.
 * shm completes a WRITE of up to 4 KiB as soon as it is queued, before the
 * peer has taken it (prov/shm/src/smr_rma.c), so with 4 KiB pages room lags
 * the completions and lazy posts are refused too: 0 to 1.2 million times per
 * 100,000 WRITEs on a 2-core VM with Debian's libfabric 1.17, in the range of
 * chapter 14's refusals there, 8,000 to 1.5 million (scripts/tour.py, three runs
 * of 3 repeats on 2026-12-01).
 */
#include "engine/lane.h"

/* Up to `batch` new WRITEs into the pending ring, not posted: drain() does that. */
static int enqueue(struct lane *l, unsigned batch)
{
    for (unsigned n = 0; n < batch && l->submitted < l->iters - 1
                         && l->pend_len < l->pend_cap; n++)
        l->pending[(l->pend_head + l->pend_len++) % l->pend_cap] = l->submitted++ % l->nmsgs;
    return send_last(l);
}

struct visit_args {
    unsigned batch;
    struct counter *done;
};

static ssize_t visit(struct lane *l, void *args)
{
    struct visit_args *a = args;
    struct counter *done = a->done;
    ssize_t rc = enqueue(l, a->batch);  /* up to `batch` new WRITEs per visit */
    if (rc == 0)
        rc = reap(l);
    if (rc > 0)  /* its only writer: a plain store the main thread may read */
        __atomic_store_n(&done->value, done->value + (uint64_t)rc, __ATOMIC_RELAXED);
    if (rc > 0)  /* n completions: room for n WRITEs */
        rc = drain(l, (size_t)rc);
    else if (rc == 0 && l->nfree == l->nslots)  /* nothing in flight: fill up */
        rc = drain(l, l->nslots);
    return rc;
}

int worker(struct lane *lanes, size_t nlanes, unsigned batch, struct counter *done,
           int *stop, int *failed_lane)
{
    struct visit_args args = {batch, done};
    return run_lanes(lanes, nlanes, stop, failed_lane, visit, &args);
}

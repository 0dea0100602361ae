/* cdef
struct lane {
    struct fid_ep *ep;
    struct fid_cq *cq;
    struct fi_msg_rma *msgs;       // this NIC's WRITE messages, built once
    size_t nmsgs;
    uint64_t iters, submitted, completed, eagain;
    struct fi_context2 *contexts;  // one per WRITE in flight
    uint8_t *busy;                 // 1 while that context's WRITE is in flight
    size_t *free_slots, nfree, nslots;
    size_t *pending, pend_head, pend_len, pend_cap;  // messages waiting for room
};
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
 * (millions of them in a run). Now submitting only puts the WRITE in the
 * ring, and the ring is posted only after reading the CQ gave completions
 * back: as many WRITEs as completed, since that is the room they left. Once
 * the provider is full (one refusal, at the start), the posts that are made
 * are the ones that succeed.
 */
#include <rdma/fi_rma.h>

#define CQ_BATCH 64

static int post(struct lane *l, size_t msg, uint64_t flags)
{
    if (!l->nfree)
        return -FI_EAGAIN;  /* every context in flight: wait like for the provider */
    size_t slot = l->free_slots[--l->nfree];
    l->msgs[msg].context = &l->contexts[slot];
    ssize_t rc = fi_writemsg(l->ep, &l->msgs[msg], flags);
    if (rc == 0) {
        l->busy[slot] = 1;
        return 0;
    }
    l->free_slots[l->nfree++] = slot;
    if (rc == -FI_EAGAIN)
        l->eagain++;
    return (int)rc;
}

/* Post up to `room` WRITEs from the pending ring, oldest first (fewer if the provider is
   full after all). */
static int drain(struct lane *l, size_t room)
{
    for (; l->pend_len && room; room--) {
        int rc = post(l, l->pending[l->pend_head], FI_COMPLETION);
        if (rc == -FI_EAGAIN)
            return 0;
        if (rc)
            return rc;
        l->pend_head = (l->pend_head + 1) % l->pend_cap;
        l->pend_len--;
    }
    return 0;
}

/* Up to `batch` new WRITEs into the ring; drain() posts them. */
static int submit(struct lane *l, unsigned batch)
{
    uint64_t last = l->iters - 1;
    for (unsigned n = 0; n < batch && l->submitted < last && l->pend_len < l->pend_cap; n++) {
        l->pending[(l->pend_head + l->pend_len++) % l->pend_cap] = l->submitted % l->nmsgs;
        l->submitted++;
    }
    if (l->submitted == last && l->completed == last) {  /* the last, with immediate data */
        size_t msg = last % l->nmsgs;
        l->msgs[msg].data = l->iters;
        int rc = post(l, msg, FI_COMPLETION | FI_REMOTE_CQ_DATA);
        if (rc && rc != -FI_EAGAIN)
            return rc;
        if (rc == 0)
            l->submitted++;
    }
    return 0;
}

/* Read completions; each gives its context back. Returns WRITEs completed, or < 0. */
static ssize_t reap(struct lane *l)
{
    struct fi_cq_data_entry entries[CQ_BATCH];
    ssize_t n = fi_cq_read(l->cq, entries, CQ_BATCH);
    if (n == -FI_EAGAIN)
        return 0;
    if (n < 0)
        return n;  /* -FI_EAVAIL: Python reads the error entry and its text */
    for (ssize_t i = 0; i < n; i++) {
        size_t slot = (struct fi_context2 *)entries[i].op_context - l->contexts;
        if (slot >= l->nslots || !l->busy[slot])
            return -FI_EOTHER;  /* a completion for no WRITE in flight */
        l->busy[slot] = 0;
        l->free_slots[l->nfree++] = slot;
    }
    l->completed += n;
    return n;
}

int worker(struct lane *lanes, size_t nlanes, unsigned batch, struct counter *done,
           int *stop, int *failed_lane)
{
    size_t busy = nlanes;
    while (busy && !__atomic_load_n(stop, __ATOMIC_RELAXED)) {
        busy = 0;
        for (size_t i = 0; i < nlanes; i++) {
            struct lane *l = &lanes[i];
            if (l->completed == l->iters)
                continue;
            busy++;
            ssize_t rc = submit(l, batch);
            if (rc == 0)
                rc = reap(l);
            if (rc > 0)  /* its only writer: a plain store the main thread may read */
                __atomic_store_n(&done->value, done->value + (uint64_t)rc, __ATOMIC_RELAXED);
            if (rc > 0)  /* n completions: room for n WRITEs */
                rc = drain(l, (size_t)rc);
            else if (rc == 0 && l->nfree == l->nslots)  /* nothing in flight: fill up */
                rc = drain(l, l->nslots);
            if (rc < 0) {
                *failed_lane = (int)i;
                return (int)rc;
            }
        }
    }
    return 0;
}

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
int worker(struct lane *lanes, size_t nlanes, uint64_t *total, int *stop, int *failed_lane);
*/
/* Chapter 11's worker: the loop of chapters 09-10, in C, for one thread.
 *
 * Python starts one thread per GPU and calls worker in it; cffi releases
 * the GIL for the call, so the threads really run at the same time. The loop
 * is the one of common/multinet.py: visit each lane, post WRITEs (a refused
 * one waits in the lane's pending ring, in order), read the CQ, and send each
 * NIC's last WRITE with immediate data once its others have completed. The
 * count of completed WRITEs is shared by all threads: an atomic add.
 */
#include <rdma/fi_rma.h>

#define BURST 1  /* new WRITEs per visit: one, as in the series; chapter 14 posts more */
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

/* Post from the pending ring, oldest first, until it is empty or the provider is full. */
static int drain(struct lane *l)
{
    while (l->pend_len) {
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

/* Up to BURST new WRITEs into the ring (posted at once when it was empty). */
static int submit(struct lane *l)
{
    uint64_t last = l->iters - 1;
    for (int n = 0; n < BURST && l->submitted < last && l->pend_len < l->pend_cap; n++) {
        size_t msg = l->submitted % l->nmsgs;
        int rc = l->pend_len ? -FI_EAGAIN : post(l, msg, FI_COMPLETION);
        if (rc == -FI_EAGAIN)
            l->pending[(l->pend_head + l->pend_len++) % l->pend_cap] = msg;
        else if (rc)
            return rc;
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

int worker(struct lane *lanes, size_t nlanes, uint64_t *total, int *stop, int *failed_lane)
{
    size_t busy = nlanes;
    while (busy && !__atomic_load_n(stop, __ATOMIC_RELAXED)) {
        busy = 0;
        for (size_t i = 0; i < nlanes; i++) {
            struct lane *l = &lanes[i];
            if (l->completed == l->iters)
                continue;
            busy++;
            ssize_t rc = submit(l);
            if (rc == 0)
                rc = reap(l);
            if (rc > 0)
                __atomic_add_fetch(total, (uint64_t)rc, __ATOMIC_RELAXED);
            if (rc >= 0)  /* also with nothing completed: a refusal may be over */
                rc = drain(l);
            if (rc < 0) {
                *failed_lane = (int)i;
                return (int)rc;
            }
        }
    }
    return 0;
}

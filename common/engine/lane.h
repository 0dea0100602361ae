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
    size_t sq_size;                // the send queue: tx_attr.size of the lane's fi_info
};
*/
/* One NIC ("lane") as the C workers of chapters 11-15 drive it.
 *
 * What every worker does with a lane is here: post() one WRITE, taking a
 * free context; submit() new WRITEs, at once while nothing waits (submit_more(): in
 * batches, chapter 14); drain() the
 * ring of WRITEs refused with -FI_EAGAIN, oldest first; send each NIC's last
 * WRITE with immediate data once its others have completed; reap()
 * completions, giving contexts back; run_lanes() visits the lanes in turn.
 * What a visit does is each chapter's lesson: its C file includes this and
 * writes visit(). (struct lane, declared in the comment above, is compiled
 * ahead of the chapter by common/_build_native.py.)
 */
#include <rdma/fi_rma.h>

#define CQ_BATCH 64

static inline int post(struct lane *l, size_t msg, uint64_t flags)
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

/* Post up to `room` WRITEs from the pending ring, oldest first, stopping at a refusal. */
static inline int drain(struct lane *l, size_t room)
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

/* The lane's last WRITE, with immediate data (how many WRITEs this NIC carried), once
   all its others have completed. */
static inline int send_last(struct lane *l)
{
    uint64_t last = l->iters - 1;
    if (l->submitted != last || l->completed != last)
        return 0;
    size_t msg = last % l->nmsgs;
    l->msgs[msg].data = l->iters;
    int rc = post(l, msg, FI_COMPLETION | FI_REMOTE_CQ_DATA);
    if (rc == 0)
        l->submitted++;
    return rc == -FI_EAGAIN ? 0 : rc;
}

/* Up to `batch` new WRITEs, posted at once while none waits (refused ones wait in the
   ring, in order); then the last one when its time has come. `more` (FI_MORE, chapter 14)
   goes on each WRITE posted but the last of the batch: the visit's posts, as many as
   there are free contexts (a WRITE post() holds back for want of one never reaches the
   provider and could not close the batch), and no more than the send queue has room for
   besides the WRITEs in flight. Past that room efa-direct's rdma-core path accepts each
   WRITE with FI_MORE and rolls the whole batch back at the closing post
   (prov/efa/src/efa_data_path_ops.h efa_ibv_post_write: ibv_wr_complete), so the WRITEs
   after it go one doorbell each, refused one by one where the queue is full. A refusal
   closes a batch too (man fi_rma(3): the provider flushes what it held back; the direct
   path rings it, efa_data_path_direct_entry.h efa_data_path_direct_post_write). */
static inline int submit_more(struct lane *l, unsigned batch, uint64_t more)
{
    size_t todo = batch, left = l->submitted < l->iters - 1 ? l->iters - 1 - l->submitted : 0;
    todo = todo < left ? todo : left;
    todo = todo < l->pend_cap - l->pend_len ? todo : l->pend_cap - l->pend_len;
    size_t posts = l->pend_len ? 0 : todo < l->nfree ? todo : l->nfree;
    /* in flight until we read its completion: efa frees a send queue entry at the CQ read
       (efa_data_path_direct_internal.h efa_wq_put_wrid_idx; rdma-core likewise) */
    size_t in_flight = l->nslots - l->nfree;
    size_t room = l->sq_size > in_flight ? l->sq_size - in_flight : 0;
    size_t batched = posts < room ? posts : room;
    for (size_t n = 0; n < todo; n++) {
        size_t msg = l->submitted % l->nmsgs;
        uint64_t flags = FI_COMPLETION | (n + 1 < batched ? more : 0);
        int rc = l->pend_len ? -FI_EAGAIN : post(l, msg, flags);
        if (rc == -FI_EAGAIN)
            l->pending[(l->pend_head + l->pend_len++) % l->pend_cap] = msg;
        else if (rc)
            return rc;
        l->submitted++;
    }
    return send_last(l);
}

static inline int submit(struct lane *l, unsigned batch)
{
    return submit_more(l, batch, 0);
}

/* Read completions; each gives its context back. Returns WRITEs completed, or < 0. */
static inline ssize_t reap(struct lane *l)
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

/* Visit each unfinished lane in turn until all are done or *stop is set. A visit that
   fails (< 0) ends the run with its code, and its lane's index in *failed_lane. */
static inline int run_lanes(struct lane *lanes, size_t nlanes, int *stop, int *failed_lane,
                            ssize_t (*visit)(struct lane *, void *), void *arg)
{
    size_t busy = nlanes;
    while (busy && !__atomic_load_n(stop, __ATOMIC_RELAXED)) {
        busy = 0;
        for (size_t i = 0; i < nlanes; i++) {
            if (lanes[i].completed == lanes[i].iters)
                continue;
            busy++;
            ssize_t rc = visit(&lanes[i], arg);
            if (rc < 0) {
                *failed_lane = (int)i;
                return (int)rc;
            }
        }
    }
    return 0;
}

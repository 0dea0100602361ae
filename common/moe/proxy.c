/* cdef
struct m16_proxy {
    struct fid_ep **eps;            // per NIC of this rank (one endpoint each) ...
    struct fid_cq **cqs;            // ... its CQ ...
    void **descs;                   // ... and the descriptor of the region registered on it
    uint32_t nics;
    char *base;                     // this rank's registered region
    uint32_t *nic;                  // per rank: which of our NICs talks to it
    fi_addr_t *addr;                // per rank: its NIC's address in that NIC's AV
    uint64_t *remote_base, *remote_key;  // per rank (only peers on other nodes are used)
    struct m16_write *ring;         // commands from the device side (host memory the
    uint64_t ring_size;             // GPU can write; a power of two)
    uint64_t *head;                 // commands written so far (device side, release)
    uint64_t posted, completed;     // WRITEs handed to libfabric / completed (proxy)
    uint64_t eagain;                // times the provider said "full, later"
    struct fi_context2 *contexts;   // one per ring slot
    uint8_t *busy;                  // 1 while that slot's WRITE is in flight
    uint32_t *arrived;              // [kinds][world] stamps: host memory the device side reads
    uint32_t world, kinds;
    int (*settle)(void *);          // or NULL: called before stamping (see m16_settle) ...
    int (*flush)(int, int);         // ... and cuFlushGPUDirectRDMAWrites, or NULL
    int flush_scope;
    int stop;                       // set by Python to end the loop
    int failed_call;                // 1: fi_writemsg, 2: fi_cq_read, 3: a stray completion,
                                    // 4: settle, 5: flush
    uint32_t failed_nic;            // where fi_writemsg or fi_cq_read failed
    int settle_error;               // what settle or flush returned
};
int m16_proxy_run(struct m16_proxy *p);
void m16_submit(struct m16_proxy *p, uint64_t local, uint64_t remote, uint64_t len,
                uint32_t peer, uint32_t imm);
uint64_t m16_completed(struct m16_proxy *p);
int m16_settle(struct m16_proxy *p);
void m16_set_stamp(uint32_t *table, size_t at, uint32_t stamp);
int m16_all_stamped(uint32_t *row, int64_t *sources, size_t n, uint32_t stamp);
*/
/* The host proxy of chapter 16 (and 17): the thread that drives the NIC for the device side.
 *
 * The device side (the GPU kernels; numpy with --device cpu) never calls
 * libfabric. It writes commands ("WRITE these bytes to that peer, with this
 * immediate") into a ring in host memory and moves `head`; this loop, in its
 * own thread with the GIL released, posts them, reads the CQ, and turns each
 * immediate that arrives into a stamp in the arrival table, the same table
 * that peers on this node stamp directly. Waiting for data is then one thing
 * for the device side: look at a stamp, whichever way the data came.
 *
 * A rank may have several NICs (its GPU's, chapter 08): one endpoint and CQ
 * on each, each peer served by one of them (Python picks which), and every CQ
 * read, for our completions and for the immediates of peers that chose it.
 *
 * The immediate says what arrived: kind (2 bits), source rank (16), stamp (14).
 */
#include <sched.h>
#include <rdma/fi_rma.h>

#define M16_BATCH 64

static void m16_note_immediate(struct m16_proxy *p, uint64_t imm)
{
    uint32_t kind = (uint32_t)(imm >> 30) & 3, source = (uint32_t)(imm >> 14) & 0xFFFF;
    if (kind < p->kinds && source < p->world)
        __atomic_store_n(&p->arrived[kind * p->world + source], (uint32_t)(imm & 0x3FFF),
                         __ATOMIC_RELEASE);
}

/* Post what the device side queued, in order, until the provider says -FI_EAGAIN. */
static int m16_post(struct m16_proxy *p)
{
    uint64_t head = __atomic_load_n(p->head, __ATOMIC_ACQUIRE);
    while (p->posted < head) {
        uint64_t slot = p->posted & (p->ring_size - 1);
        if (p->busy[slot])
            return 0;  /* that slot's previous WRITE has not completed yet */
        struct m16_write *w = &p->ring[slot];
        uint32_t n = p->nic[w->peer];
        struct iovec iov = { p->base + w->local, w->len };
        struct fi_rma_iov rma = { p->remote_base[w->peer] + w->remote, w->len,
                                  p->remote_key[w->peer] };
        struct fi_msg_rma msg = { &iov, &p->descs[n], 1, p->addr[w->peer], &rma, 1,
                                  &p->contexts[slot], w->imm };
        ssize_t rc = fi_writemsg(p->eps[n], &msg, FI_COMPLETION | FI_REMOTE_CQ_DATA);
        if (rc == -FI_EAGAIN) {
            p->eagain++;
            return 0;
        }
        if (rc) {
            p->failed_nic = n;
            return (int)rc;
        }
        p->busy[slot] = 1;
        p->posted++;
    }
    return 0;
}

/* Before a stamp tells the device side that bytes have arrived, make them
 * readable there. A provider that copies with CUDA calls from this thread
 * (shm) may report a WRITE whose copy still runs on the GPU: `settle`
 * (cudaStreamSynchronize on CUDA's legacy stream, where those copies go) waits
 * for it. A NIC writes into GPU memory by itself (GPUDirect RDMA); where the
 * device does not order such writes for the consumer, `flush`
 * (cuFlushGPUDirectRDMAWrites on this thread's current context, the GPU's)
 * makes them visible first, as NCCL does. Returns 0, or the failed step. */
int m16_settle(struct m16_proxy *p)
{
    if (p->settle && (p->settle_error = p->settle(NULL)))
        return 4;
    if (p->flush && (p->settle_error = p->flush(0, p->flush_scope)))
        return 5;
    return 0;
}

/* Read one NIC's completions: ours free their slot, a peer's immediate becomes a stamp. */
static ssize_t m16_reap(struct m16_proxy *p, uint32_t nic)
{
    struct fi_cq_data_entry entries[M16_BATCH];
    ssize_t n = fi_cq_read(p->cqs[nic], entries, M16_BATCH);
    if (n == -FI_EAGAIN)
        return 0;
    if (n < 0) {
        p->failed_nic = nic;
        return n;  /* -FI_EAVAIL: Python reads the error entry and its text */
    }
    int arrivals = 0;
    for (ssize_t i = 0; i < n; i++)
        arrivals |= (entries[i].flags & FI_REMOTE_CQ_DATA) != 0;
    if (arrivals && (p->failed_call = m16_settle(p)))
        return -FI_EOTHER;
    for (ssize_t i = 0; i < n; i++) {
        if (entries[i].flags & FI_REMOTE_CQ_DATA) {
            m16_note_immediate(p, entries[i].data);
            continue;
        }
        size_t slot = (struct fi_context2 *)entries[i].op_context - p->contexts;
        if (slot >= p->ring_size || !p->busy[slot]) {
            p->failed_call = 3;
            return -FI_EOTHER;
        }
        p->busy[slot] = 0;
        __atomic_add_fetch(&p->completed, 1, __ATOMIC_RELEASE);
    }
    return n;
}

int m16_proxy_run(struct m16_proxy *p)
{
    while (!__atomic_load_n(&p->stop, __ATOMIC_ACQUIRE)) {
        uint64_t before = p->posted;
        int rc = m16_post(p);
        if (rc) {
            p->failed_call = 1;
            return rc;
        }
        ssize_t seen = 0;
        for (uint32_t nic = 0; nic < p->nics; nic++) {
            ssize_t n = m16_reap(p, nic);
            if (n < 0) {
                if (!p->failed_call)
                    p->failed_call = 2;
                return (int)n;
            }
            seen += n;
        }
        if (seen == 0 && p->posted == before)
            sched_yield();  /* idle: let the device side (or another rank) have the core */
    }
    return 0;
}

/* The device side's half: one command into the ring. The caller has checked
 * that the ring has room (head - completed < ring_size). */
void m16_submit(struct m16_proxy *p, uint64_t local, uint64_t remote, uint64_t len,
                uint32_t peer, uint32_t imm)
{
    uint64_t head = *p->head;
    struct m16_write *w = &p->ring[head & (p->ring_size - 1)];
    w->local = local;
    w->remote = remote;
    w->len = len;
    w->peer = peer;
    w->imm = imm;
    __atomic_store_n(p->head, head + 1, __ATOMIC_RELEASE);
}

uint64_t m16_completed(struct m16_proxy *p)
{
    return __atomic_load_n(&p->completed, __ATOMIC_ACQUIRE);
}

/* The node-local path: a peer copies the data into our region, then stamps our table.
 * A release store and acquire loads make "stamp seen" mean "data readable". */
void m16_set_stamp(uint32_t *table, size_t at, uint32_t stamp)
{
    __atomic_store_n(&table[at], stamp, __ATOMIC_RELEASE);
}

int m16_all_stamped(uint32_t *row, int64_t *sources, size_t n, uint32_t stamp)
{
    for (size_t i = 0; i < n; i++)
        if (__atomic_load_n(&row[sources[i]], __ATOMIC_ACQUIRE) != stamp)
            return 0;
    return 1;
}

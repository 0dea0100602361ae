/* cdef
struct tx_command {             // one transfer: `count` WRITEs of `length` bytes to one peer
    uint64_t count, length;
    uint64_t *lengths;              // or NULL: WRITE i is lengths[i] bytes long
    uint64_t *src, *dst;            // byte offsets into the local and the remote region
    char *local_base;               // the local region (its virtual address) ...
    void **local_descs;             // ... and its descriptor on each NIC
    uint64_t *remote_base, *remote_key;  // the remote region on each of the peer's NICs
    fi_addr_t *addr;                // the peer's NIC i in our NIC i's AV
    uint32_t nic;                   // the NIC of every WRITE (per-peer spread) ...
    uint32_t round_robin;           // ... or 1: each WRITE to the next NIC
    uint64_t imm;                   // immediate data of every WRITE, when has_imm
    uint32_t has_imm;
    uint64_t inject_size;           // WRITEs this short are injected (no completion); 0: none
    // progress, written by the worker
    uint64_t posted, completed, skipped; // skipped: not posted after the command failed
    int32_t status;                 // 0, or the first failure (a negative fi_errno) ...
    uint32_t failed_nic;
    char error[200];                // ... and its text (the provider's, fi_cq_strerror)
    uint64_t ns[4];                 // CLOCK_MONOTONIC: queued, first and last WRITE posted, done
};
struct tx_worker {
    uint32_t nics;
    struct fid_ep **eps;            // per NIC: the data endpoint ...
    struct fid_cq **cqs;            // ... and its CQ
    uint32_t slots;                 // WRITEs one NIC may have in flight (a CQ entry each)
    struct tx_command **ring;       // commands Python queued, a power of two of them
    uint64_t ring_size;
    uint64_t head;                  // commands queued (Python, through tx_submit)
    uint64_t tail;                  // commands whose WRITEs have all been posted (worker)
    uint64_t posted, completed, eagain, arrived, injected;  // totals, for stats()
    uint64_t *imm_keys;             // the arrival table: immediate value ...
    uint64_t *imm_counts;           // ... how many WRITEs carried it ...
    uint8_t *imm_used;              // ... and whether the slot holds one (open addressing)
    uint32_t imm_size;              // a power of two
    uint64_t imm_lost;              // arrivals of a new value while the table was full
    uint64_t remote_errors;         // error entries for no WRITE of ours (a peer's failed one)
    char remote_error[200];
    uint32_t nap_us;                // sleep this long when idle a while (0: only yield)
    int stop;                       // set by Python to end the loop
    int failed_call;                // 1: fi_cq_read, 2: fi_cq_readerr, 3: a stray completion,
    uint32_t failed_nic;            // 4: out of memory, 5: an error entry after injected WRITEs
    int rc;
    void *state;                    // what tx_run allocates (after pinning), tx_free frees
    struct tx_inbox *inbox;         // arrivals by CUDA IPC (common/transfer/ipc.py), or NULL
};
struct tx_inbox_slot {              // one writer's ring in a reader's inbox (64 bytes)
    uint64_t owner;                 // the writer's engine id + 1, 0: free (claimed by CAS)
    uint64_t consumed;              // records the reader has counted (the reader writes it)
    uint64_t pad[6];
};
struct tx_inbox_record {            // one command of that writer (32 bytes)
    uint64_t seq;                   // its number + 1, written by the writer's kernel last
    uint64_t imm, count, has_imm;   // written by the writer's host before the launch
};
struct tx_inbox {
    char magic[8];
    uint32_t writers, records;      // slots, records per slot (a power of two)
    uint64_t pad[6];
    struct tx_inbox_slot slot[];    // then records[writers][records]
};
int64_t tx_inbox_claim(struct tx_inbox *box, uint64_t owner);
struct tx_inbox_record *tx_inbox_records(struct tx_inbox *box, uint32_t slot);
struct tx_inbox_record *tx_inbox_next(struct tx_inbox_record *records, uint64_t mask,
                                      uint64_t head, uint64_t imm, int has_imm, uint64_t count);
int tx_run(struct tx_worker *w);
void tx_free(struct tx_worker *w);
void tx_submit(struct tx_worker *w, struct tx_command *c);
uint64_t tx_tail(struct tx_worker *w);
uint64_t tx_done(struct tx_command *c);
int32_t tx_status(struct tx_command *c);
uint64_t tx_arrived(struct tx_worker *w, uint64_t imm);
int64_t tx_offsets(const void *items, int is_signed, uint64_t n, uint64_t scale,
                   uint64_t length, const uint64_t *lengths, uint64_t size, uint64_t *out);
uint64_t tx_hash(uint64_t imm, uint32_t size);
*/
/* The transfer engine's worker: one thread per GPU that owns its NICs' data path.
 *
 * What chapters 09-15 taught, in one loop. Python queues commands in a ring
 * (tx_submit): "these WRITEs, offsets in two arrays, to that peer, each with
 * this immediate"; the worker posts them lazily (chapter 15): first it reaps
 * every NIC's CQ, then it posts a batch, and after the provider said
 * -FI_EAGAIN only as many as completed, so refused posts do not pile up;
 * each WRITE goes to the next NIC (round-robin) or the peer's one (per-peer).
 * A local completion advances its command; an arrival with immediate data
 * (FI_REMOTE_CQ_DATA) adds one to that value's count in the arrival table,
 * which Python reads (tx_arrived): whoever waits for n WRITEs counts them,
 * in any order, from any NIC. A failed WRITE's error entry (fi_cq_readerr)
 * is kept in its command, in the provider's words, for Python to raise.
 * A command may ask for its short WRITEs to be injected (fi_inject_write*):
 * the provider copies the source before the call returns and writes no
 * completion, so such a WRITE is done once posted.
 * A peer on this host that writes our GPU memory by CUDA IPC (ipc.py) skips
 * the NICs: its kernel marks each finished command in our inbox, shared host
 * memory the worker polls, and the command's immediates join the same table.
 */
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#include <rdma/fi_rma.h>

#define TX_BATCH 64     /* CQ entries read at once; WRITEs posted per visit while not refused */
#define TX_IDLE 1024    /* idle visits before the worker naps instead of only yielding */

struct tx_slot {
    struct fi_context2 context;     /* first: the completion's op_context points here */
    struct tx_command *command;
};

struct tx_state {
    struct tx_slot *slots;          /* [nics][slots] */
    uint32_t *free_slots;           /* [nics][slots]: free slot indices of each NIC */
    uint32_t *nfree;                /* [nics] */
    uint64_t op;                    /* next WRITE of the command at tail */
    uint32_t next_nic;              /* round-robin */
    int refused;                    /* the provider said -FI_EAGAIN, WRITEs are still in flight */
};

uint64_t tx_hash(uint64_t imm, uint32_t size)
{
    return (imm * 0x9E3779B97F4A7C15ull >> 32) & (size - 1);
}

/* `n` more WRITEs with immediate `imm` arrived (n > 1: a command by CUDA IPC, counted
   at once). The worker is the table's only writer: the key is written before the slot is
   marked used (release), the count after. */
static void tx_note_n(struct tx_worker *w, uint64_t imm, uint64_t n)
{
    w->arrived += n;
    uint64_t at = tx_hash(imm, w->imm_size);
    for (uint32_t probe = 0; probe < w->imm_size; probe++, at = (at + 1) & (w->imm_size - 1)) {
        if (!w->imm_used[at]) {
            w->imm_keys[at] = imm;
            __atomic_store_n(&w->imm_used[at], 1, __ATOMIC_RELEASE);
        } else if (w->imm_keys[at] != imm) {
            continue;
        }
        __atomic_add_fetch(&w->imm_counts[at], n, __ATOMIC_RELEASE);
        return;
    }
    __atomic_add_fetch(&w->imm_lost, n, __ATOMIC_RELEASE);  /* full: Python says so */
}

static void tx_note(struct tx_worker *w, uint64_t imm)
{
    tx_note_n(w, imm, 1);
}

/* How many WRITEs with immediate `imm` have arrived so far (Python's side). */
uint64_t tx_arrived(struct tx_worker *w, uint64_t imm)
{
    uint64_t at = tx_hash(imm, w->imm_size);
    for (uint32_t probe = 0; probe < w->imm_size; probe++, at = (at + 1) & (w->imm_size - 1)) {
        if (!__atomic_load_n(&w->imm_used[at], __ATOMIC_ACQUIRE))
            return 0;
        if (w->imm_keys[at] == imm)
            return __atomic_load_n(&w->imm_counts[at], __ATOMIC_ACQUIRE);
    }
    return 0;
}

struct tx_inbox_record *tx_inbox_records(struct tx_inbox *box, uint32_t slot)
{
    struct tx_inbox_record *all = (struct tx_inbox_record *)&box->slot[box->writers];
    return all + (size_t)slot * box->records;
}

/* A writer's next command in its ring of a reader's inbox (number `head`), filled but for
   its seq: the writer's kernel stores that, head + 1, after the bytes, and the reader
   counts the command once it is there. */
struct tx_inbox_record *tx_inbox_next(struct tx_inbox_record *records, uint64_t mask,
                                      uint64_t head, uint64_t imm, int has_imm, uint64_t count)
{
    struct tx_inbox_record *r = &records[head & mask];
    r->imm = imm;
    r->count = count;
    r->has_imm = (uint64_t)has_imm;
    return r;
}

/* A writer takes a free slot of a reader's inbox: its index, or -1 if all are taken. It
   goes on from the slot's `consumed`, where a writer before it stopped. */
int64_t tx_inbox_claim(struct tx_inbox *box, uint64_t owner)
{
    for (uint32_t i = 0; i < box->writers; i++) {
        uint64_t free_ = 0;
        if (__atomic_compare_exchange_n(&box->slot[i].owner, &free_, owner, 0,
                                        __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return i;
    }
    return -1;
}

/* Count the commands that writers' kernels finished into our GPU memory: a record is
   done once its seq is its number + 1, which the kernel stores after a system-wide fence
   (common/transfer/ipc.cu), so everything it wrote is visible by then. Returns how many. */
static uint64_t tx_inbox_poll(struct tx_worker *w)
{
    struct tx_inbox *box = w->inbox;
    uint64_t seen = 0;
    for (uint32_t i = 0; i < box->writers; i++) {
        if (!__atomic_load_n(&box->slot[i].owner, __ATOMIC_ACQUIRE))
            continue;
        struct tx_inbox_record *ring = tx_inbox_records(box, i);
        uint64_t at = box->slot[i].consumed;
        for (;;) {
            struct tx_inbox_record *r = &ring[at & (box->records - 1)];
            if (__atomic_load_n(&r->seq, __ATOMIC_ACQUIRE) != at + 1)
                break;
            if (r->has_imm)
                tx_note_n(w, r->imm, r->count);
            at++;
            seen++;
            __atomic_store_n(&box->slot[i].consumed, at, __ATOMIC_RELEASE);  /* room */
        }
    }
    return seen;
}

static void tx_fail(struct tx_command *c, uint32_t nic, int rc, const char *text)
{
    if (c->status)
        return;  /* the first failure is the one reported */
    strncpy(c->error, text, sizeof c->error - 1);
    c->failed_nic = nic;
    __atomic_store_n(&c->status, rc ? rc : -FI_EOTHER, __ATOMIC_RELEASE);
}

/* A command's timeline (ns[]): where a short transfer's time goes. */
enum { TX_QUEUED, TX_FIRST_POST, TX_LAST_POST, TX_DONE };

static uint64_t tx_now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static void tx_complete(struct tx_worker *w, struct tx_command *c, uint64_t n)
{
    if (c->completed + c->skipped + n >= c->count)
        c->ns[TX_DONE] = tx_now();  /* before the count: Python reads it once that is full */
    __atomic_add_fetch(&c->completed, n, __ATOMIC_RELEASE);
    __atomic_add_fetch(&w->completed, n, __ATOMIC_RELEASE);
}

/* Read one NIC's CQ. Returns our WRITEs completed (room for as many), or < 0. */
static ssize_t tx_reap(struct tx_worker *w, struct tx_state *s, uint32_t nic)
{
    struct fi_cq_data_entry entries[TX_BATCH];
    ssize_t n = fi_cq_read(w->cqs[nic], entries, TX_BATCH);
    if (n == -FI_EAGAIN)
        return 0;
    if (n == -FI_EAVAIL) {  /* a failed operation: its entry, in the provider's words */
        struct fi_cq_err_entry err;
        memset(&err, 0, sizeof err);
        ssize_t rc = fi_cq_readerr(w->cqs[nic], &err, 0);
        if (rc == -FI_EAGAIN)
            return 0;
        if (rc < 0) {
            w->failed_call = 2;
            return rc;
        }
        char text[200];
        const char *said = fi_cq_strerror(w->cqs[nic], err.prov_errno, err.err_data,
                                          text, sizeof text);
        if (!said || !*said)
            said = fi_strerror(err.err);
        struct tx_slot *slot = err.op_context;
        struct tx_slot *first = &s->slots[(size_t)nic * w->slots];
        if (slot < first || slot >= first + w->slots || !slot->command) {
            /* No slot of ours: a peer's WRITE that failed here, or, once we injected, maybe
               one of ours: it has no context to name it, and no command waits for it (shm
               writes such errors with a NULL context, prov/shm/src/smr_rma.c
               smr_generic_rma, smr_progress.c smr_progress_cmd_rma). An injected WRITE
               must not fail unseen: then the whole engine fails, in the provider's words. */
            strncpy(w->remote_error, said, sizeof w->remote_error - 1);
            if (w->injected) {
                w->failed_call = 5;
                return -(ssize_t)(err.err ? err.err : FI_EOTHER);
            }
            __atomic_add_fetch(&w->remote_errors, 1, __ATOMIC_RELEASE);
            return 0;
        }
        struct tx_command *c = slot->command;
        tx_fail(c, nic, -(int)err.err, said);
        slot->command = NULL;
        s->free_slots[(size_t)nic * w->slots + s->nfree[nic]++] = (uint32_t)(slot - first);
        tx_complete(w, c, 1);
        return 1;
    }
    if (n < 0) {
        w->failed_call = 1;
        return n;
    }
    ssize_t ours = 0;
    struct tx_slot *first = &s->slots[(size_t)nic * w->slots];
    for (ssize_t i = 0; i < n; i++) {
        if (entries[i].flags & FI_REMOTE_CQ_DATA) {
            tx_note(w, entries[i].data);
            continue;
        }
        struct tx_slot *slot = entries[i].op_context;
        if (slot < first || slot >= first + w->slots || !slot->command) {
            w->failed_call = 3;
            return -FI_EOTHER;
        }
        struct tx_command *c = slot->command;
        slot->command = NULL;
        s->free_slots[(size_t)nic * w->slots + s->nfree[nic]++] = (uint32_t)(slot - first);
        tx_complete(w, c, 1);
        ours++;
    }
    return ours;
}

/* Post up to `budget` WRITEs of the queued commands, in order. Stops at the first
   -FI_EAGAIN (counted, and remembered: then only as many as complete are posted) or
   when the NIC a WRITE needs has every slot in flight. Returns how many were posted.
   Injected WRITEs are counted done once per visit and command: two locked adds for each,
   on lines Python polls, took a fifth of the worker's samples on shm (perf, 4 KiB). */
static uint64_t tx_post(struct tx_worker *w, struct tx_state *s, uint64_t budget)
{
    uint64_t done = 0, quiet = 0;           /* quiet: injected WRITEs of `injected` */
    struct tx_command *injected = NULL;     /* not yet counted */
    uint64_t head = __atomic_load_n(&w->head, __ATOMIC_ACQUIRE);
    while (done < budget && w->tail < head) {
        struct tx_command *c = w->ring[w->tail & (w->ring_size - 1)];
        if (c->status || s->op >= c->count) {  /* finished posting it (or it failed) */
            if (s->op < c->count)
                __atomic_store_n(&c->skipped, c->count - s->op, __ATOMIC_RELEASE);
            s->op = 0;
            __atomic_store_n(&w->tail, w->tail + 1, __ATOMIC_RELEASE);
            continue;
        }
        uint32_t nic = c->round_robin ? s->next_nic : c->nic;
        uint64_t op = s->op, length = c->lengths ? c->lengths[op] : c->length;
        int inject = length <= c->inject_size;
        if (!inject && !s->nfree[nic])
            break;  /* that NIC is full: its completions make room */
        struct tx_slot *slot = inject ? NULL : &s->slots[(size_t)nic * w->slots
                                       + s->free_slots[(size_t)nic * w->slots + s->nfree[nic] - 1]];
        char *from = c->local_base + c->src[op];
        uint64_t to = c->remote_base[nic] + c->dst[op];
        ssize_t rc;
        if (inject && c->has_imm) {
            rc = fi_inject_writedata(w->eps[nic], from, length, c->imm, c->addr[nic], to,
                                     c->remote_key[nic]);
        } else if (inject) {
            rc = fi_inject_write(w->eps[nic], from, length, c->addr[nic], to, c->remote_key[nic]);
        } else {
            struct iovec iov = { from, length };
            struct fi_rma_iov rma = { to, length, c->remote_key[nic] };
            struct fi_msg_rma msg = { &iov, &c->local_descs[nic], 1, c->addr[nic], &rma, 1,
                                      &slot->context, c->imm };
            /* One doorbell per WRITE: no FI_MORE (chapter 14's batches), on any fabric.
               Round robin puts consecutive WRITEs on different endpoints, so a batch
               per endpoint would stay open across the others' posts and CQ reads, its
               last WRITE known only after the fact; efa's own fabric, which 18 and 19
               run on too, never rings for a WRITE it queued under FI_MORE before
               libfabric 2.7 (chapters/14_batch.py EFA_RINGS_QUEUED); and NIXL, moving
               KV caches over the same fabrics, turned FI_MORE off on EFA. */
            uint64_t flags = FI_COMPLETION | (c->has_imm ? FI_REMOTE_CQ_DATA : 0);
            rc = fi_writemsg(w->eps[nic], &msg, flags);
        }
        if (rc == -FI_EAGAIN) {
            w->eagain++;
            s->refused = 1;
            break;
        }
        if (rc) {
            tx_fail(c, nic, (int)rc, fi_strerror((int)-rc));
            continue;  /* the rest of it is skipped above */
        }
        s->op++;
        if (s->op == 1 || s->op == c->count) {
            uint64_t now = tx_now();
            c->ns[TX_LAST_POST] = now;
            if (s->op == 1)
                c->ns[TX_FIRST_POST] = now;
        }
        __atomic_store_n(&c->posted, c->posted + 1, __ATOMIC_RELEASE);
        w->posted++;
        if (inject) {  /* no completion will come: done now, counted below */
            w->injected++;
            if (c != injected && quiet)
                tx_complete(w, injected, quiet);
            quiet = c == injected ? quiet + 1 : 1;
            injected = c;
        } else {
            slot->command = c;
            s->nfree[nic]--;
        }
        done++;
        if (c->round_robin)
            s->next_nic = (s->next_nic + 1) % w->nics;
    }
    if (quiet)
        tx_complete(w, injected, quiet);
    return done;
}

static struct tx_state *tx_alloc(struct tx_worker *w)
{
    struct tx_state *s = calloc(1, sizeof *s);
    size_t all = (size_t)w->nics * w->slots;
    if (!s || !(s->slots = calloc(all, sizeof *s->slots))
        || !(s->free_slots = calloc(all, sizeof *s->free_slots))
        || !(s->nfree = calloc(w->nics, sizeof *s->nfree)))
        return s;
    for (uint32_t nic = 0; nic < w->nics; nic++) {
        for (uint32_t i = 0; i < w->slots; i++)
            s->free_slots[(size_t)nic * w->slots + i] = w->slots - 1 - i;
        s->nfree[nic] = w->slots;
    }
    return s;
}

/* The loop, until Python sets stop or a call fails. Its memory is allocated here, by
   the (pinned) thread that uses it (chapter 12), and freed by tx_free once the
   endpoints are closed: a WRITE still in flight owns its context until then. */
int tx_run(struct tx_worker *w)
{
    struct tx_state *s = w->state = tx_alloc(w);
    if (!s || !s->nfree) {
        w->failed_call = 4;
        return w->rc = -FI_ENOMEM;
    }
    unsigned idle = 0;
    while (!__atomic_load_n(&w->stop, __ATOMIC_ACQUIRE)) {
        ssize_t room = 0;
        for (uint32_t nic = 0; nic < w->nics; nic++) {
            uint64_t arrived = w->arrived;
            ssize_t n = tx_reap(w, s, nic);
            if (n < 0) {
                w->failed_nic = nic;
                return w->rc = (int)n;
            }
            room += n;
            idle = (n || w->arrived != arrived) ? 0 : idle;
        }
        /* Refused, post only as many as completed (chapter 15) until nothing is in flight
           (then nothing could make room: a connection still being set up). Clearing it on
           any completion retried a whole batch against full queues, refused about 8 times
           per 10 WRITEs of 64 KiB on shm: it holds tx_size (1024) of them, the peer rx_size
           (prov/shm/src/smr_ep.c smr_do_iov, smr_rma.c smr_generic_rma). */
        if (w->posted == w->completed)
            s->refused = 0;
        uint64_t posted = tx_post(w, s, s->refused ? (uint64_t)room : TX_BATCH);
        uint64_t seen = w->inbox ? tx_inbox_poll(w) : 0;  /* CUDA IPC's arrivals */
        if (posted || room || seen) {
            idle = 0;
            continue;
        }
        if (++idle < TX_IDLE || !w->nap_us) {
            sched_yield();  /* nothing to do: let the other threads of a busy host run */
        } else {
            struct timespec nap = { 0, (long)w->nap_us * 1000 };
            nanosleep(&nap, NULL);
        }
    }
    return 0;
}

void tx_free(struct tx_worker *w)
{
    struct tx_state *s = w->state;
    if (s) {
        free(s->slots);
        free(s->free_slots);
        free(s->nfree);
        free(s);
    }
    w->state = NULL;
}

/* Python's half: queue one command. The caller checked there is room
   (head - tx_tail() < ring_size). */
void tx_submit(struct tx_worker *w, struct tx_command *c)
{
    c->ns[TX_QUEUED] = tx_now();
    w->ring[w->head & (w->ring_size - 1)] = c;
    __atomic_store_n(&w->head, w->head + 1, __ATOMIC_RELEASE);
}

uint64_t tx_tail(struct tx_worker *w)
{
    return __atomic_load_n(&w->tail, __ATOMIC_ACQUIRE);
}

/* WRITEs of the command that are over: completed (well or not) or never posted. */
uint64_t tx_done(struct tx_command *c)
{
    return __atomic_load_n(&c->completed, __ATOMIC_ACQUIRE)
           + __atomic_load_n(&c->skipped, __ATOMIC_ACQUIRE);
}

int32_t tx_status(struct tx_command *c)
{
    return __atomic_load_n(&c->status, __ATOMIC_ACQUIRE);
}

/* A command's byte offsets, built and checked in one pass (numpy took six over the
   arrays): out[i] = items[i] * scale, where items are int64 (is_signed) or uint64 page
   numbers (scale: the page size) or offsets (scale 1, which `lengths` needs), and WRITE
   i, `length` bytes or lengths[i], must lie inside a region of `size` bytes. Returns -1,
   or the index of the first item that is negative or out of range: the caller refuses
   the command. */
int64_t tx_offsets(const void *items, int is_signed, uint64_t n, uint64_t scale,
                   uint64_t length, const uint64_t *lengths, uint64_t size, uint64_t *out)
{
    const int64_t *signed_items = items;
    const uint64_t *unsigned_items = items;
    /* the largest item whose WRITE fits: one division, not one per item (tens of cycles) */
    uint64_t last = length <= size ? (size - length) / scale : 0;
    if (!lengths && length > size && n)
        return 0;
    for (uint64_t i = 0; i < n; i++) {
        if (is_signed && signed_items[i] < 0)
            return (int64_t)i;
        uint64_t item = unsigned_items[i];
        if (lengths ? lengths[i] > size || item > size - lengths[i] : item > last)
            return (int64_t)i;  /* lengths come with scale 1 (byte offsets) */
        if (out)  /* NULL: only check */
            out[i] = item * scale;
    }
    return -1;
}

/* cdef
struct tx_copier {                  // ipc.py's Copier: ipc.cu's kernel and the ring of its tables
    void *launch, *upload;          // the driver's cuLaunchKernel and cuMemcpyHtoDAsync_v2 ...
    void *record, *wait;            // ... cuEventRecord and cuStreamWaitEvent
    void *kernel, *stream;          // ipc_copy (a CUfunction) and the stream its commands run on
    void *context;                  // their CUDA context, made current where it is not ...
    void *get_context, *set_context;  // ... by cuCtxGetCurrent, cuCtxSetCurrent (or NULL)
    void *uploads, *uploaded;       // a stream for the uploads and its event (or NULL: `stream`)
    uint64_t *host;                 // the ring: pinned host memory, where tables are written ...
    uint64_t device;                // ... and a copy on the GPU, where uploads put them
    uint64_t entries, head;         // the ring's size (uint64 entries) and its next free entry
    uint64_t direct;                // tables this short are read by the kernel from `host`
    uint64_t blocks_done;           // the kernel's counter of finished blocks (device memory)
    uint64_t chunk;                 // bytes a block copies before it takes the next piece
    uint32_t threads, max_blocks;
    volatile uint64_t *finished;    // the number of the last kernel that ran (it stores it
    uint64_t launched;              // there: pinned memory) and of the last one launched
    uint64_t span_start[1024], span_kernel[1024];  // the tables in use, oldest first, and the
    uint64_t spans_queued, spans_freed;            // kernel each waits for
    void *stand, *stand_stream;     // ipc.cu's resident kernel (or NULL: none), its stream
    volatile uint64_t *queue;       // its queue (pinned host memory: ipc.cu's ipc_stand) ...
    uint64_t scratch;               // ... and its GPU memory
    uint64_t idle_ns;               // how long it stays on the GPU without a job
    uint64_t stand_items;           // prepared commands of at most this many chunks go to it
    uint32_t stand_blocks;          // its blocks: a leader and the workers
    uint64_t stand_launches, stand_jobs;
    volatile uint64_t *slot_seq_at[64];  // each slot's last job: where its seq lands, and
    uint64_t slot_seq[64];               // that seq (the slot is free once it is there)
    int rc;                         // a failed driver call's CUresult
};
struct tx_copy {                    // one command, as Engine.write_pages & co. give it
    const void *src_items, *dst_items;  // page numbers or byte offsets, int64 or uint64 ...
    int src_signed, dst_signed;
    uint64_t count, scale;          // ... times `scale` (the kernel's product): byte offsets
    uint64_t length;                // every copy's length, or 0 and ...
    const uint64_t *lengths;        // ... each one's
    uint64_t src_size, dst_size;    // the two regions' sizes ...
    uint64_t src, dst;              // ... and device addresses (dst: the peer's, mapped here)
    volatile uint64_t *seq_at;      // where the last kernel stores `seq` (the peer's record,
    uint64_t seq;                   // or NULL)
    uint64_t sent;                  // copies launched so far (a call may stop for room)
    uint64_t table, longest;        // a prepared command: its table on the GPU (byte offsets,
    int table_lengths;              // then lengths if it has them) and its longest copy
    int64_t bad;                    // out: the first item out of range, and on which side
    int bad_side;                   // (0: source, 1: destination)
};
int tx_copy(struct tx_copier *c, struct tx_copy *a);
int tx_copier_room(struct tx_copier *c, uint64_t entries);
uint64_t tx_copy_piece(struct tx_copier *c, struct tx_copy *a);
int tx_copy_prepared(struct tx_copier *c, struct tx_copy *a);
int tx_write_prepared(struct tx_copier *c, struct tx_copy *a, struct tx_inbox_record *records,
                      uint64_t mask, uint64_t head, uint64_t imm, int has_imm, uint64_t src,
                      uint64_t dst);
*/
/* The CUDA IPC route's launches (common/transfer/ipc.py), in C: a command's page lists
 * checked and turned into the table ipc.cu reads, written straight into a pinned ring,
 * uploaded and launched by the driver's own calls, which Python hands over as pointers
 * (no CUDA toolkit to build). In Python the same took 30-90 us a command on an H200 box,
 * as long as the kernel of 100 pages, or the kernel of 10,000 pages of 4 KiB.
 *
 * A table (source items, destination items, then lengths where they differ) takes
 * consecutive entries of the ring, which it keeps until the kernel that reads it is done:
 * each kernel stores its number in `finished` last (the stream runs them in order). A
 * table of at most `direct` entries is read by the kernel from pinned memory (mapped for
 * the GPU: one copy fewer to queue); a longer one is uploaded first, on a stream of its
 * own that the kernel's waits for, so that the upload of one command's table overlaps the
 * kernel of the one before. A command too long for half the ring goes as several
 * kernels, in the stream's order, its items all checked before the first; only the last
 * stores the command's seq. A prepared command (commands.Prepared) has its table on the GPU
 * already, checked once when it was made: its launch is the launch alone, and where
 * the copier has a resident kernel (ipc.cu's ipc_stand) a small one is not even that:
 * a job of ten words in the kernel's queue.
 */
typedef int (*tx_launch_fn)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, void *stream,
                            void **params, void **extra);
typedef int (*tx_upload_fn)(uint64_t dst, const void *src, size_t bytes, void *stream);
typedef int (*tx_record_fn)(void *event, void *stream);
typedef int (*tx_wait_fn)(void *stream, void *event, unsigned flags);
typedef int (*tx_get_context_fn)(void **context);
typedef int (*tx_set_context_fn)(void *context);

/* The copier's context current in this thread: a thread-local read where it is already
   (a launch from Python that set the device first cost 0.8 us more on an H200 box) */
static int tx_copier_context(struct tx_copier *c)
{
    void *now = NULL;
    if (!c->get_context)
        return 0;
    c->rc = ((tx_get_context_fn)c->get_context)(&now);
    if (!c->rc && now != c->context)
        c->rc = ((tx_set_context_fn)c->set_context)(c->context);
    return c->rc ? -1 : 0;
}

static void tx_copier_free(struct tx_copier *c)
{
    while (c->spans_freed < c->spans_queued) {
        if (*c->finished < c->span_kernel[c->spans_freed & 1023])
            break;
        c->spans_freed++;
    }
}

/* Where a table of `n` entries fits now, or -1. Tables are taken in order around the
   ring (one that does not fit before its end starts again at 0), so those in use run
   from the oldest's start up to head; head equal to that start means the ring is full. */
static int64_t tx_copier_at(struct tx_copier *c, uint64_t n)
{
    tx_copier_free(c);
    if (c->spans_queued == c->spans_freed)
        return 0;
    if (c->spans_queued - c->spans_freed == 1024)
        return -1;
    uint64_t oldest = c->span_start[c->spans_freed & 1023];
    if (c->head > oldest)  /* in use: [oldest, head) */
        return c->head + n <= c->entries ? (int64_t)c->head : n <= oldest ? 0 : -1;
    return c->head + n <= oldest ? (int64_t)c->head : -1;  /* in use: all but [head, oldest) */
}

int tx_copier_room(struct tx_copier *c, uint64_t entries)
{
    return tx_copier_at(c, entries) >= 0;
}

/* The copies the next kernel of `a` takes: all that are left where they fit half the ring */
uint64_t tx_copy_piece(struct tx_copier *c, struct tx_copy *a)
{
    uint64_t per = a->lengths ? 3 : 2, most = c->entries / 2 / per;
    uint64_t left = a->count - a->sent;
    return left < most ? left : most;
}

/* Copy n items to `out` (where not NULL): the index of the first above `last`, or -1.
   One pass without a branch an item, then a second only where one is out of range: the
   engine's one-pass check (tx_offsets, with its multiply) took 2 ns an item on an H200
   box's Xeon, 20 us for 10,000 pages, as long as the kernel that copies them at 4 KiB;
   the kernel multiplies instead. */
static int64_t tx_items(const uint64_t *restrict item, uint64_t n, uint64_t last,
                        uint64_t *restrict out)
{
    uint64_t largest = 0;
    if (out) {
        for (uint64_t i = 0; i < n; i++) {
            out[i] = item[i];
            largest = item[i] > largest ? item[i] : largest;
        }
    } else {
        for (uint64_t i = 0; i < n; i++)
            largest = item[i] > largest ? item[i] : largest;
    }
    for (uint64_t i = 0; largest > last && i < n; i++)
        if (item[i] > last)
            return (int64_t)i;
    return -1;
}

/* Check the items of copies [from, from + n) of `a` and, where `out` is not NULL, write
   their table there. Returns 0, or 1 with a->bad and a->bad_side set. */
static int tx_copy_table(struct tx_copy *a, uint64_t from, uint64_t n, uint64_t *out)
{
    const uint64_t *lengths = a->lengths ? a->lengths + from : NULL;
    const char *items[2] = {a->src_items, a->dst_items};
    int is_signed[2] = {a->src_signed, a->dst_signed};
    uint64_t sizes[2] = {a->src_size, a->dst_size};
    for (int side = 0; side < 2; side++) {
        const uint64_t *mine = (const uint64_t *)(items[side] + 8 * from);
        uint64_t *to = out ? out + side * n : NULL;
        int64_t at;
        if (lengths) {  /* byte offsets (scale 1), each its own length */
            at = tx_offsets(mine, is_signed[side], n, 1, 0, lengths, sizes[side], to);
        } else if (a->length > sizes[side]) {
            at = n ? 0 : -1;
        } else {  /* the largest item whose copy fits; a negative one, as unsigned, is more */
            uint64_t last = (sizes[side] - a->length) / a->scale;
            at = tx_items(mine, n, is_signed[side] && last > INT64_MAX ? INT64_MAX : last, to);
        }
        if (at >= 0) {
            a->bad = (int64_t)from + at;
            a->bad_side = side;
            return 1;
        }
    }
    if (out && lengths)
        memcpy(out + 2 * n, lengths, 8 * n);
    return 0;
}

/* The chunks each copy of at most `longest` bytes is cut in */
static uint64_t tx_per_copy(struct tx_copier *c, uint64_t longest)
{
    return (longest + c->chunk - 1) / c->chunk;
}

/* Queue ipc_copy on the stream: n copies of `a` whose table is at device address `table`,
   the command's last kernel (`last`: it stores the command's seq) or not. 0, or -1 with
   c->rc the driver's error. */
static int tx_launch(struct tx_copier *c, struct tx_copy *a, uint64_t table, uint64_t n,
                     int has_lengths, uint64_t longest, int last)
{
    uint64_t per_copy = tx_per_copy(c, longest), count = n;
    uint64_t blocks = count * per_copy < c->max_blocks ? count * per_copy : c->max_blocks;
    uint64_t length = has_lengths ? 0 : a->length;
    const uint64_t src = a->src, dst = a->dst;
    volatile uint64_t *seq_at = last ? a->seq_at : NULL;
    uint64_t number = c->launched + 1;
    void *params[] = {(void *)&src, (void *)&dst, &table, &a->scale, &count, &length,
                      &has_lengths, &c->chunk, &per_copy, (void *)&seq_at, &a->seq,
                      (void *)&c->finished, &number, &c->blocks_done};
    c->rc = ((tx_launch_fn)c->launch)(c->kernel, blocks ? (unsigned)blocks : 1, 1, 1,
                                      c->threads, 1, 1, 0, c->stream, params, NULL);
    if (c->rc)
        return -1;
    c->launched = number;
    return 0;
}

enum { TX_SLOTS = 64, TX_JOB = 10 };  /* ipc.cu's STAND_SLOTS, STAND_JOB, STAND_* */
enum { TX_RUNNING = 1, TX_LEAVING = 2, TX_STOPPED = 3 };

/* Hand prepared command `a` to the resident kernel (launched again where it had left):
   0 once its job is in the queue; 1 where its slot's last job is not done yet (launch
   `a` instead); -1 (c->rc). */
static int tx_stand(struct tx_copier *c, struct tx_copy *a, uint64_t per_copy)
{
    volatile uint64_t *q = c->queue;
    uint64_t k = q[0], s = k % TX_SLOTS;
    if (c->slot_seq_at[s] && *c->slot_seq_at[s] < c->slot_seq[s])
        return 1;
    uint64_t job[TX_JOB] = {a->src, a->dst, a->table, a->scale, a->count,
                            a->table_lengths ? 0 : a->length, (uint64_t)a->table_lengths,
                            per_copy, (uint64_t)(uintptr_t)a->seq_at, a->seq};
    for (int i = 0; i < TX_JOB; i++)
        q[4 + s * TX_JOB + i] = job[i];
    c->slot_seq_at[s] = a->seq_at;
    c->slot_seq[s] = a->seq;
    c->stand_jobs++;
    /* Dekker's handshake with the kernel's leader (ipc.cu): our count, a fence, its state */
    __atomic_store_n(&q[0], k + 1, __ATOMIC_SEQ_CST);
    uint64_t state, since = 0;
    while ((state = __atomic_load_n(&q[1], __ATOMIC_SEQ_CST)) == TX_LEAVING) {
        if (!since) {  /* the leader is between its two looks, a few loads away */
            since = tx_now();
        } else if (tx_now() - since > 1000000000u) {
            c->rc = 702;  /* CUDA_ERROR_LAUNCH_TIMEOUT: it never finished them */
            return -1;
        }
    }
    if (state == TX_RUNNING)
        return 0;
    if (tx_copier_context(c))
        return -1;
    uint64_t start = q[2], epoch = c->stand_launches + 1, chunk = c->chunk;
    q[1] = TX_RUNNING;
    void *params[] = {(void *)&c->queue, &c->scratch, &start, &epoch, &c->idle_ns, &chunk};
    c->rc = ((tx_launch_fn)c->launch)(c->stand, c->stand_blocks, 1, 1, c->threads, 1, 1, 0,
                                      c->stand_stream, params, NULL);
    if (c->rc) {
        q[1] = TX_STOPPED;
        return -1;
    }
    c->stand_launches = epoch;
    return 0;
}

/* Launch prepared command `a` (a->table), or hand it to the resident kernel where there
   is one and `a` is small: 0, or -1 (c->rc) */
int tx_copy_prepared(struct tx_copier *c, struct tx_copy *a)
{
    uint64_t per_copy = tx_per_copy(c, a->longest);
    if (c->stand && a->seq_at && a->count * per_copy <= c->stand_items) {
        int rc = tx_stand(c, a, per_copy);
        if (rc <= 0)
            return rc;
    }
    if (tx_copier_context(c))
        return -1;
    return tx_launch(c, a, a->table, a->count, a->table_lengths, a->longest, 1);
}

/* Launch what is left of command `a`: 0 once all of it is queued on the stream; 1: an
   item is out of range (nothing launched); 2: no room in the ring yet (a->sent says how
   far it got: call again); -1: a driver call failed (c->rc). */
int tx_copy(struct tx_copier *c, struct tx_copy *a)
{
    if (tx_copier_context(c))
        return -1;
    if (a->sent == 0 && tx_copy_piece(c, a) < a->count && tx_copy_table(a, 0, a->count, NULL))
        return 1;  /* several kernels: every item checked before the first */
    while (a->sent < a->count || a->count == 0) {
        uint64_t n = tx_copy_piece(c, a), per = a->lengths ? 3 : 2, entries = per * n;
        int64_t start = tx_copier_at(c, entries);
        if (start < 0)
            return 2;
        uint64_t *table = c->host + start;
        if (tx_copy_table(a, a->sent, n, table))
            return 1;
        uint64_t longest = a->length;
        for (uint64_t i = 0; a->lengths && i < n; i++)
            longest = a->lengths[a->sent + i] > longest ? a->lengths[a->sent + i] : longest;
        int last = a->sent + n == a->count;
        uint64_t device = c->device + 8 * (uint64_t)start;
        if (entries > c->direct) {
            c->rc = ((tx_upload_fn)c->upload)(device, table, 8 * entries,
                                              c->uploads ? c->uploads : c->stream);
            if (!c->rc && c->uploads)
                c->rc = ((tx_record_fn)c->record)(c->uploaded, c->uploads);
            if (!c->rc && c->uploads)
                c->rc = ((tx_wait_fn)c->wait)(c->stream, c->uploaded, 0);
            if (c->rc)
                return -1;
        } else {
            device = (uint64_t)(uintptr_t)table;  /* pinned: the same address for the GPU */
        }
        if (tx_launch(c, a, device, n, a->lengths != NULL, longest, last))
            return -1;
        if (entries) {  /* its span, free once this kernel ran */
            uint64_t i = c->spans_queued++ & 1023;
            c->span_start[i] = (uint64_t)start;
            c->span_kernel[i] = c->launched;
            c->head = (uint64_t)start + entries;
        }
        a->sent += n;
        if (a->count == 0)
            break;
    }
    return 0;
}

/* Prepared.write on the CUDA IPC route, in one call from Python (each field it set there
   cost about 0.1 us): the command's record in the peer's inbox, at `head` of our ring of
   mask + 1, filled but for its seq (the kernel stores head + 1 there last), `a` moved to
   `src` and `dst`, then tx_copy_prepared. 0, or -1 (c->rc). */
int tx_write_prepared(struct tx_copier *c, struct tx_copy *a, struct tx_inbox_record *records,
                      uint64_t mask, uint64_t head, uint64_t imm, int has_imm, uint64_t src,
                      uint64_t dst)
{
    struct tx_inbox_record *r = tx_inbox_next(records, mask, head, imm, has_imm, a->count);
    a->seq_at = &r->seq;
    a->seq = head + 1;
    a->src = src;
    a->dst = dst;
    return tx_copy_prepared(c, a);
}

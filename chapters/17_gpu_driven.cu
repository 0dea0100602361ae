// Chapter 17's kernels: the GPU drives the all-to-all (cupy RawModule, with the fp8
// wire format of common/gpu/fp8.cuh). Run on 2 x H200 and on one.
#include "device.cuh"  // common/gpu/: the clock, block sums, row copies, bf16
#include "fp8.cuh"

// No host in the loop. Every rank's region (cudaMalloc, mapped by the node's ranks through CUDA IPC) holds
//   flags      uint32 [2][world]: the round each peer last finished (counts, combine)
//   slots      [world][header | private rows]: a sender's counts and its first rows
//   overflow   [world][per_peer rows]: the rest, a stripe per sender
//   combine_in [world][per_peer bf16 rows]: what each peer's experts sent back
// A sender's stream to a peer is its selections of that peer's experts, by expert, then
// by token; row q of it lands in the sender's slot (q < private) or in its stripe.
// Writes to peers are plain stores through mapped pointers (NVLink); the last block of
// a kernel, once every block fenced its stores, stores the round into each peer's flag.
//
// Peers on other nodes get the same bytes at the same offsets, through the proxy: the
// kernels lay a peer's rows out in an outbox of our own region, exactly as they would
// land, and the last block queues the WRITEs in the proxy's ring (host memory the GPU
// writes); the proxy posts them with immediate data, and the peer's proxy stamps its
// arrival table (host memory the peer's GPU reads). `far` holds what that takes, as
// 64-bit numbers (see M17_FAR).

#define M17_COUNTS 0   // the flags of node peers, [2][world] in the region
#define M17_COMBINE 1
#define M17_STAMP_COUNTS 0    // the proxy's arrival table, [3][world] (the immediate's kind)
#define M17_STAMP_OVERFLOW 1
#define M17_STAMP_COMBINE 2
// far[]: our node's first rank and size; offsets in our region of the outbox slots
// [world][slot], outbox stripes [world][per_peer rows], combine's outbox [world][per_peer
// bf16 rows], signal_in [world][8] and signal_out [8] (a WRITE of no rows still tells);
// then addresses of host memory: the proxy's ring, its head, the ring's size, the table.
enum M17_FAR { M17_NODE_FIRST, M17_NODE_SIZE, M17_OUT_SLOTS, M17_OUT_STRIPES,
               M17_COMBINE_OUT, M17_SIGNAL_IN, M17_SIGNAL_OUT, M17_RING, M17_HEAD,
               M17_RING_SIZE, M17_STAMPS };

#include "ring.h"  // struct m16_write: the proxy's ring entry (common/moe/ring.h)

__device__ bool m17_near(const long long *far, int rank)
{
    return rank >= far[M17_NODE_FIRST] && rank < far[M17_NODE_FIRST] + far[M17_NODE_SIZE];
}

__device__ unsigned int m17_stamp(unsigned int round)  // 14 bits, never 0
{
    return round % 0x3FFF + 1;
}

// One thread: wait until every source has finished `round`: a node peer's flag (this
// kind's row) has reached it, another node's stamps of kinds a and b say it. Returns the
// first source that did not within timeout_ns, or -1.
__device__ int m17_wait(const long long *far, const volatile unsigned int *flags, int world,
                        unsigned int round, int a, int b, unsigned long long timeout_ns)
{
    const volatile unsigned int *stamps = (const volatile unsigned int *)far[M17_STAMPS];
    unsigned int stamp = m17_stamp(round);
    unsigned long long start = gpu_now();
    for (int s = 0; s < world;) {
        bool in = m17_near(far, s) ? (int)(flags[s] - round) >= 0
                                   : stamps[a * world + s] == stamp && stamps[b * world + s] == stamp;
        if (in) {
            s++;
        } else if (gpu_now() - start > timeout_ns) {
            return s;
        } else {
            __nanosleep(64);
        }
    }
    __threadfence_system();  // what the flags announce is read after them
    return -1;
}

// Called by every thread of every block at its end: true in thread 0 of the last block
// to finish, once every block's stores are visible everywhere; it then stores `round`
// into flag word `flag_at` of each node peer's region, and tells the other nodes itself.
__device__ bool m17_last_block(unsigned int *done, const unsigned long long *peers,
                               const long long *far, long long flag_at, unsigned int round)
{
    __syncthreads();  // this block's stores are issued...
    if (threadIdx.x != 0)
        return false;
    __threadfence_system();  // ...and visible everywhere before it counts itself done
    if (atomicAdd(done, 1u) != gridDim.x - 1)
        return false;
    __threadfence_system();  // the last: every block's stores are visible, then the flags
    for (int peer = far[M17_NODE_FIRST]; peer < far[M17_NODE_FIRST] + far[M17_NODE_SIZE];
         peer++)
        *(volatile unsigned int *)(peers[peer] + flag_at) = round;
    *done = 0;  // for the next launch (stream-ordered after this one)
    return true;
}

// The last block's thread, one command into the proxy's ring (it is the only producer:
// `at` is the head it read, moved on here and stored by m17_ring_go).
__device__ void m17_queue(const long long *far, unsigned long long *at, long long local,
                          long long remote, long long len, int peer, unsigned int kind,
                          int rank, unsigned int round)
{
    struct m16_write *w = (struct m16_write *)far[M17_RING] +
                          (*at & (far[M17_RING_SIZE] - 1));
    w->local = local;
    w->remote = remote;
    w->len = len;
    w->peer = peer;
    w->imm = kind << 30 | (unsigned int)rank << 14 | m17_stamp(round);
    (*at)++;
}

// A WRITE of `len` bytes, or with none to send, of the 8-byte signal: either way the
// peer's proxy stamps `kind` for us, and its kernels stop waiting.
__device__ void m17_queue_rows(const long long *far, unsigned long long *at, long long local,
                               long long remote, long long len, int peer, unsigned int kind,
                               int rank, unsigned int round)
{
    if (len > 0)
        m17_queue(far, at, local, remote, len, peer, kind, rank, round);
    else
        m17_queue(far, at, far[M17_SIGNAL_OUT], far[M17_SIGNAL_IN] + 8 * rank, 8, peer, kind,
                  rank, round);
}

__device__ void m17_ring_go(const long long *far, unsigned long long at)
{
    __threadfence_system();  // the commands before the head that shows them
    *(volatile unsigned long long *)far[M17_HEAD] = at;
}

// dispatch, 1: a block per expert counts its selections and numbers them in token order
// (a ballot per warp, warps in turn), so the layout is the same every run. It also
// checks the batch: *error becomes 1 for an index out of range (block 0 looks), 2 for
// a token naming an expert twice (that expert's block sees it); then nothing is sent.
// Blocks past the experts' quantise `tokens` tokens of x to fp8 rows meanwhile, two
// groups of 128 values a block of 256 threads: one launch less on the host (tokens 0:
// bf16, the host encoded them).
extern "C" __global__ void m17_route(const void *indices, int index_bytes, int entries,
                                     int topk, int experts, int *counts, int *position,
                                     int *error, const float *x, unsigned char *rows,
                                     int hidden, int row_bytes, int tokens,
                                     unsigned int *round_at)
{
    if (blockIdx.x == 0 && threadIdx.x == 0)  // a new layer: on the GPU, so that a graph's
        *round_at += 1;                        // replays advance it too
    if (blockIdx.x >= experts) {
        __shared__ float warp_max[8];
        int half = threadIdx.x >> 7, groups = hidden / 128;
        int g = 2 * (blockIdx.x - experts) + half;
        fp8_quantize_group(x, rows, hidden, row_bytes, g / groups, g % groups,
                           threadIdx.x & 127, g < tokens * groups, warp_max + 4 * half);
        return;
    }
    __shared__ int warp_sum[32];
    int e = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int base = 0;
    for (int first = 0; first < entries; first += blockDim.x) {
        int i = first + threadIdx.x;
        long long expert = i < entries ? index_at(indices, index_bytes, i) : -1;
        bool mine = expert == e;
        if (e == 0 && i < entries && (expert < 0 || expert >= experts))
            atomicMax(error, 1);
        for (int other = mine ? i - i % topk : 0; mine && other < i; other++)
            if (index_at(indices, index_bytes, other) == e)
                atomicMax(error, 2);
        unsigned int ballot = __ballot_sync(0xffffffffu, mine);
        if (lane == 0)
            warp_sum[warp] = __popc(ballot);
        __syncthreads();
        int before = base + __popc(ballot & ((1u << lane) - 1));
        for (int w = 0; w < warp; w++)
            before += warp_sum[w];
        if (mine)
            position[i] = before;
        for (int w = 0; w < (int)(blockDim.x >> 5); w++)
            base += warp_sum[w];
        __syncthreads();  // warp_sum is rewritten by the next chunk
    }
    if (threadIdx.x == 0)
        counts[e] = base;
}

// dispatch, 2: a block per selection pushes its token's row to the expert's rank; one
// block more per peer writes our counts into its slot for us. Then the counts flag.
extern "C" __global__ void m17_dispatch_push(
    const unsigned char *rows, const void *indices, int index_bytes, const int *position,
    const int *counts, int entries, int topk, int experts, int local, long long row_bytes,
    int private_rows, long long per_peer, const unsigned long long *peers, long long slots,
    long long slot_bytes, long long header_bytes, long long overflow, long long flags,
    int rank, int world, const unsigned int *round_at, int *stream_pos, const int *error,
    unsigned int *done, const long long *far)
{
    unsigned int round = *round_at;  // this layer's, advanced by m17_route
    if (*error)  // a bad batch: nothing leaves, no flag is raised
        return;
    int b = blockIdx.x;
    unsigned char *own = (unsigned char *)peers[rank];
    if (b < entries) {
        int e = (int)index_at(indices, index_bytes, b), d = e / local;
        int start = 0;  // the rows of d's experts before e, in our stream to d
        for (int x = d * local + threadIdx.x; x < e; x += blockDim.x)
            start += counts[x];
        int q = block_sum(start) + position[b];
        unsigned char *to = m17_near(far, d)
            ? (unsigned char *)peers[d] + (q < private_rows
                ? slots + rank * slot_bytes + header_bytes + q * row_bytes
                : overflow + (rank * per_peer + q - private_rows) * row_bytes)
            : own + (q < private_rows  // the outbox, laid out as it will land
                ? far[M17_OUT_SLOTS] + d * slot_bytes + header_bytes + q * row_bytes
                : far[M17_OUT_STRIPES] + (d * per_peer + q - private_rows) * row_bytes);
        copy_row(to, rows + (long long)(b / topk) * row_bytes, row_bytes);
        if (threadIdx.x == 0)
            stream_pos[b] = q;
    } else {
        int d = b - entries;
        int *to = (int *)(m17_near(far, d) ? (unsigned char *)peers[d] + slots + rank * slot_bytes
                                           : own + far[M17_OUT_SLOTS] + d * slot_bytes);
        for (int x = threadIdx.x; x < experts; x += blockDim.x)
            to[x] = counts[x];
    }
    if (!m17_last_block(done, peers, far, flags + 4 * (M17_COUNTS * world + rank), round) ||
        far[M17_NODE_SIZE] == world)
        return;
    unsigned long long at = *(volatile unsigned long long *)far[M17_HEAD];
    for (int d = 0; d < world; d++) {  // other nodes: the slot, then the rest (or a signal)
        if (m17_near(far, d))
            continue;
        int n = 0;
        for (int x = d * local; x < (d + 1) * local; x++)
            n += counts[x];
        m17_queue(far, &at, far[M17_OUT_SLOTS] + d * slot_bytes, slots + rank * slot_bytes,
                  header_bytes + min(n, private_rows) * row_bytes, d, M17_STAMP_COUNTS, rank,
                  round);
        m17_queue_rows(far, &at, far[M17_OUT_STRIPES] + d * per_peer * row_bytes,
                       overflow + rank * per_peer * row_bytes, (n - private_rows) * row_bytes,
                       d, M17_STAMP_OVERFLOW, rank, round);
    }
    m17_ring_go(far, at);
}

// dispatch, 3 (one block, dynamic shared memory of 3 * experts ints): wait for every
// sender's counts, then plan the expert-major output, entry x = (local expert, source):
// plan[x] its first output row, plan[E + x] its first row in the source's stream,
// plan[2E + x] its length. state (GPU memory): [0] the route's verdict, [1] the total.
// report (host memory the GPU writes, read by the host once the stream is done): rows
// per local expert, the total, the source that was late (+1, or 0), [local + 2] the same
// for combine, [local + 3] the route's verdict on the batch. received (GPU memory): the
// rows per local expert again, for GPU work that follows without the host.
extern "C" __global__ void m17_dispatch_plan(
    const unsigned char *region, long long flags, long long slots, long long slot_bytes,
    int rank, int world, int local, const unsigned int *round_at, unsigned long long timeout_ns,
    int *plan, int *state, int *report, int *received, const long long *far)
{
    unsigned int round = *round_at;  // this layer's, advanced by m17_route
    extern __shared__ int table[];  // length, then stream start, then output start
    __shared__ int late, carry;
    int E = world * local;
    if (threadIdx.x == 0) {
        report[local + 2] = 0;
        report[local + 3] = state[0];
        state[1] = 0;
    }
    for (int e = threadIdx.x; e < local; e += blockDim.x)
        received[e] = 0;  // nothing, unless the plan gets to the end
    if (state[0]) {  // our batch was refused: nobody sent us anything this round
        __syncthreads();
        if (threadIdx.x == 0)
            state[0] = 0;  // the next batch starts clean
        return;
    }
    if (threadIdx.x == 0) {
        late = m17_wait(far, (const volatile unsigned int *)(region + flags) +
                        M17_COUNTS * world, world, round, M17_STAMP_COUNTS,
                        M17_STAMP_OVERFLOW, timeout_ns);
        report[local + 1] = late + 1;
    }
    __syncthreads();
    if (late >= 0)
        return;
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        int e = x / world, s = x % world;
        const int *sent = (const int *)(region + slots + s * slot_bytes);
        table[x] = __ldcg(sent + rank * local + e);
    }
    __syncthreads();
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        int e = x / world, s = x % world, start = 0;
        for (int before = 0; before < e; before++)
            start += table[before * world + s];
        table[E + x] = start;
    }
    if (threadIdx.x == 0)
        carry = 0;
    for (int first = 0; first < E; first += blockDim.x) {  // exclusive scan of lengths
        int x = first + threadIdx.x;
        int v = x < E ? table[x] : 0, inclusive = v;
        for (int offset = 1; offset < 32; offset <<= 1) {
            int up = __shfl_up_sync(0xffffffffu, inclusive, offset);
            if ((threadIdx.x & 31) >= offset)
                inclusive += up;
        }
        __shared__ int warp_total[32];
        __syncthreads();
        if ((threadIdx.x & 31) == 31)
            warp_total[threadIdx.x >> 5] = inclusive;
        __syncthreads();
        int before = carry;
        for (int w = 0; w < (int)(threadIdx.x >> 5); w++)
            before += warp_total[w];
        if (x < E)
            table[2 * E + x] = before + inclusive - v;
        __syncthreads();
        if (threadIdx.x == blockDim.x - 1)
            carry = before + inclusive;
        __syncthreads();
    }
    for (int x = threadIdx.x; x < E; x += blockDim.x) {
        plan[x] = table[2 * E + x];
        plan[E + x] = table[E + x];
        plan[2 * E + x] = table[x];
    }
    for (int e = threadIdx.x; e < local; e += blockDim.x) {
        int rows = 0;
        for (int s = 0; s < world; s++)
            rows += table[e * world + s];
        report[e] = received[e] = rows;
    }
    if (threadIdx.x == 0)
        report[local] = state[1] = carry;
}

// dispatch, 4: blocks stride over the output rows: each finds its (expert, source) entry
// in the plan, copies the row from the slot or the stripe, and notes where it came from
// (source, row in the source's stream) for combine. A row's first `split` bytes go to
// `out`, the rest (fp8's scales) to `tail`.
extern "C" __global__ void m17_dispatch_gather(
    const unsigned char *region, const int *plan, const int *state, int local, int world,
    long long row_bytes, long long split, int private_rows, long long per_peer,
    long long slots, long long slot_bytes, long long header_bytes, long long overflow,
    unsigned char *out, unsigned char *tail, int *row_source, int *row_stream)
{
    int E = world * local, total = state[1];
    for (int j = blockIdx.x; j < total; j += gridDim.x) {
        int lo = 0, hi = E - 1;  // the last entry that starts at or before j
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if (plan[mid] <= j)
                lo = mid;
            else
                hi = mid - 1;
        }
        int s = lo % world, q = plan[E + lo] + j - plan[lo];
        long long at = q < private_rows
            ? slots + s * slot_bytes + header_bytes + q * row_bytes
            : overflow + (s * per_peer + q - private_rows) * row_bytes;
        copy_row(out + j * split, region + at, split);
        if (split < row_bytes)
            copy_row(tail + j * (row_bytes - split), region + at + split, row_bytes - split);
        if (threadIdx.x == 0) {
            row_source[j] = s;
            row_stream[j] = q;
        }
    }
}

// combine, 1: blocks stride over the received rows (state[1], the plan's total): each
// sends its row's expert output, as bf16, back into the source's combine_in stripe for
// us, at the row's place in the source's stream.
extern "C" __global__ void m17_combine_push(
    const float *expert_out, const int *row_source, const int *row_stream, const int *state,
    int hidden, const unsigned long long *peers, long long combine_in, long long per_peer,
    long long flags, int rank, int world, const unsigned int *round_at, unsigned int *done,
    const int *plan, int local, const long long *far)
{
    unsigned int round = *round_at;  // this layer's, advanced by m17_route
    for (int j = blockIdx.x, rows = state[1]; j < rows; j += gridDim.x) {
        int s = row_source[j];
        unsigned short *to = m17_near(far, s)
            ? (unsigned short *)((unsigned char *)peers[s] + combine_in) +
              (rank * per_peer + row_stream[j]) * hidden
            : (unsigned short *)((unsigned char *)peers[rank] + far[M17_COMBINE_OUT]) +
              (s * per_peer + row_stream[j]) * hidden;
        const float *from = expert_out + (long long)j * hidden;
        if (hidden % 8 == 0) {  // 16-byte stores over NVLink: 8 values a thread
            for (int h = 8 * threadIdx.x; h < hidden; h += 8 * blockDim.x) {
                float4 a = *(const float4 *)(from + h), b = *(const float4 *)(from + h + 4);
                uint4 v = {bf16_bits(a.x) | (unsigned int)bf16_bits(a.y) << 16,
                           bf16_bits(a.z) | (unsigned int)bf16_bits(a.w) << 16,
                           bf16_bits(b.x) | (unsigned int)bf16_bits(b.y) << 16,
                           bf16_bits(b.z) | (unsigned int)bf16_bits(b.w) << 16};
                *(uint4 *)(to + h) = v;
            }
        } else {
            for (int h = threadIdx.x; h < hidden; h += blockDim.x)
                to[h] = bf16_bits(from[h]);
        }
    }
    if (!m17_last_block(done, peers, far, flags + 4 * (M17_COMBINE * world + rank), round) ||
        far[M17_NODE_SIZE] == world)
        return;
    unsigned long long at = *(volatile unsigned long long *)far[M17_HEAD];
    long long bytes = 2LL * hidden, E = (long long)world * local;
    for (int s = 0; s < world; s++) {  // other nodes: their rows back, one WRITE each
        if (m17_near(far, s))
            continue;
        int n = 0;  // the rows that came from s: the plan's lengths of its entries
        for (int e = 0; e < local; e++)
            n += plan[2 * E + e * world + s];
        m17_queue_rows(far, &at, far[M17_COMBINE_OUT] + s * per_peer * bytes,
                       combine_in + rank * per_peer * bytes, n * bytes, s, M17_STAMP_COMBINE,
                       rank, round);
    }
    m17_ring_go(far, at);
}

// combine, 2: a block per token waits for every peer's outputs (the barrier before the
// next dispatch too), then sums its topk rows, weighted. report[local + 2]: the late
// source + 1 (the plan set it to 0).
extern "C" __global__ void m17_combine_sum(
    const unsigned char *region, long long flags, long long combine_in, const void *indices,
    int index_bytes, const int *stream_pos, const float *weights, int tokens, int topk,
    int hidden, int local, long long per_peer, int world, const unsigned int *round_at,
    unsigned long long timeout_ns, float *out, int *report, const long long *far,
    unsigned int *gate)
{
    unsigned int round = *round_at;  // this layer's, advanced by m17_route
    __shared__ int late;
    // One block waits on the peers and tells the others through `gate` ([round, late
    // source + 1], device memory). With a poller per block on the stamps in host memory,
    // combine across two nodes took 5x as long on 2 x H200 (shm + CUDA, libfabric 2.1.0,
    // 2026-11-30; 128 tokens: 1074 us p50, one poller 215 us; why, not pinned down). Block 0 is resident first: it cannot starve.
    volatile unsigned int *g = gate;
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        late = m17_wait(far, (const volatile unsigned int *)(region + flags) +
                        M17_COMBINE * world, world, round, M17_STAMP_COMBINE,
                        M17_STAMP_COMBINE, timeout_ns);
        g[1] = late + 1;
        __threadfence();
        g[0] = round;
    } else if (threadIdx.x == 0) {
        while (g[0] != round)
            ;
        __threadfence();
        late = (int)g[1] - 1;
    }
    __syncthreads();
    if (late >= 0) {
        if (threadIdx.x == 0)
            report[local + 2] = late + 1;
        return;
    }
    int t = blockIdx.x;
    if (t >= tokens)
        return;
    // Where each of the token's topk rows is, and its weight, looked up once: the sum
    // below then has topk independent loads in flight (reading them per value, a chain
    // of three dependent loads each, kept this kernel at 73 us on 2 x H200 at any size, on 2026-11-30).
    extern __shared__ long long source[];  // [topk] offsets in values, then [topk] weights
    float *weight = (float *)(source + topk);
    for (int k = threadIdx.x; k < topk; k += blockDim.x) {
        int i = t * topk + k;
        long long d = index_at(indices, index_bytes, i) / local;
        source[k] = (d * per_peer + stream_pos[i]) * hidden;
        weight[k] = weights[i];
    }
    __syncthreads();
    const unsigned short *rows = (const unsigned short *)(region + combine_in);
    float *to = out + (long long)t * hidden;
    if (hidden % 8 == 0) {  // 16-byte loads: 8 values a thread
        for (int h = 8 * threadIdx.x; h < hidden; h += 8 * blockDim.x) {
            float sum[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            for (int k = 0; k < topk; k++) {
                uint4 v = __ldcg((const uint4 *)(rows + source[k] + h));
                unsigned int word[4] = {v.x, v.y, v.z, v.w};
                for (int j = 0; j < 8; j++)
                    sum[j] += weight[k] * __uint_as_float(j % 2 ? word[j / 2] & 0xFFFF0000u
                                                                : word[j / 2] << 16);
            }
            *(float4 *)(to + h) = make_float4(sum[0], sum[1], sum[2], sum[3]);
            *(float4 *)(to + h + 4) = make_float4(sum[4], sum[5], sum[6], sum[7]);
        }
    } else {
        for (int h = threadIdx.x; h < hidden; h += blockDim.x) {
            float sum = 0.0f;
            for (int k = 0; k < topk; k++)
                sum += weight[k] * __uint_as_float((unsigned int)__ldcg(rows + source[k] + h)
                                                   << 16);
            to[h] = sum;
        }
    }
}

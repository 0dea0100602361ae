// The transfer engine's CUDA IPC route (common/transfer/ipc.py): one command's copies,
// made by the GPU straight into a peer's memory on this host, then marked done in the
// peer's inbox (host memory its worker polls).
#include "device.cuh"  // common/gpu/: gpu_now, the GPU's global timer

// table: the command's source items, then its destination items, then (with `lengths`)
// each copy's length; else every copy is `length` bytes. An item times `scale` is a
// byte offset (the host checked them all: common/transfer/copier.c). A copy is cut in
// `per_copy` chunks of `chunk` bytes (a multiple of 16), so that 100 pages of 64 KiB
// keep every SM busy; a block takes chunks in turn, 16 bytes a thread where it can.
// This is chunk w: bytes [w % per_copy * chunk, + chunk) of copy w / per_copy.
__device__ void ipc_chunk(const char *src, char *dst, const unsigned long long *table,
                          unsigned long long scale, unsigned long long count,
                          unsigned long long length, int lengths, unsigned long long chunk,
                          unsigned long long per_copy, unsigned long long w)
{
    unsigned long long p = w / per_copy, start = w % per_copy * chunk;
    unsigned long long n = lengths ? table[2 * count + p] : length;
    if (start >= n)
        return;
    unsigned long long end = min(n, start + chunk);
    const char *from = src + table[p] * scale;
    char *to = dst + table[count + p] * scale;
    unsigned long long wide = ((unsigned long long)from | (unsigned long long)to) % 16
                              ? start : start + (end - start) / 16 * 16;
    for (unsigned long long i = start + 16 * threadIdx.x; i < wide; i += 16 * blockDim.x)
        *(uint4 *)(to + i) = *(const uint4 *)(from + i);
    for (unsigned long long i = wide + threadIdx.x; i < end; i += blockDim.x)
        to[i] = from[i];
}

extern "C" __global__ void ipc_copy(const char *src, char *dst,
                                    const unsigned long long *table,
                                    unsigned long long scale, unsigned long long count, unsigned long long length,
                                    int lengths, unsigned long long chunk,
                                    unsigned long long per_copy,
                                    volatile unsigned long long *seq_at,
                                    unsigned long long seq,
                                    volatile unsigned long long *finished,
                                    unsigned long long number, unsigned int *blocks_done)
{
    for (unsigned long long w = blockIdx.x; w < count * per_copy; w += gridDim.x)
        ipc_chunk(src, dst, table, scale, count, length, lengths, chunk, per_copy, w);
    // Every thread's stores reach the whole system (the peer's GPU and every CPU)
    // before what it stores next (fence.sc.sys); the last block to get here then
    // publishes the command. A reader that sees `seq` and only then starts its own
    // kernels reads what was copied: the stores land in its GPU's memory (its L2), and
    // a kernel starts with a clean L1. Unlike a NIC's GPUDirect writes, nothing to flush
    // (cuFlushGPUDirectRDMAWrites is for third-party devices).
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(blocks_done, 1) == gridDim.x - 1) {
        *blocks_done = 0;  // for the next kernel: the stream runs them one at a time
        __threadfence_system();
        if (seq_at)        // the command's last kernel: it is done
            *seq_at = seq;
        *finished = number;  // the host may reuse this kernel's table
    }
}

// The resident copier (Engine(resident=True)): ipc_copy's work for small prepared
// commands, by a kernel that stays on the GPU while they come, so that a command costs a
// few stores into pinned memory instead of a launch (15 us from the call to a mark in
// host memory on an H200 VM, for an empty kernel; 4 us for a resident kernel to see a
// host's store and answer it).
//
// queue (pinned host memory, mapped): [0] jobs published by the host, [1] the kernel's
// state (STAND_*), [2] the first job it did not take when it left, [3] quit, then
// STAND_SLOTS jobs of STAND_JOB words: src, dst, table, scale, count, length, lengths,
// per_copy, seq_at, seq (ipc_copy's arguments). scratch (GPU memory): [0] jobs handed
// to the workers, [1] the epoch of the launch that told them to leave, then each slot's
// count of workers done, then the jobs' words, copied there by the leader.
//
// Block 0 is the leader: its warp polls the queue and hands jobs out. After `idle_ns`
// without one (or soon after quit is set) it leaves, by Dekker's handshake with the
// host (copier.c tx_stand): it stores LEAVING, fences, and reads the queue once more; the
// host stores the job count, fences, and reads the state. One of the two sees the
// other's store: a job is either taken, or the host sees STOPPED and launches the kernel
// again from queue[2]. The other blocks take every job in order, each its share of the
// chunks, as ipc_copy's blocks do; the last one done with a job stores its seq.
#define STAND_SLOTS 64
#define STAND_JOB 10
#define STAND_RUNNING 1
#define STAND_LEAVING 2
#define STAND_STOPPED 3

extern "C" __global__ void ipc_stand(volatile unsigned long long *queue,
                                     volatile unsigned long long *scratch,
                                     unsigned long long start, unsigned long long epoch,
                                     unsigned long long idle_ns, unsigned long long chunk)
{
    volatile unsigned long long *jobs = scratch + 2 + STAND_SLOTS;  // the queue's, copied
    if (blockIdx.x == 0) {  // the leader: warp 0 (lane 0 polls, lanes copy a job's words)
        if (threadIdx.x >= 32)
            return;
        unsigned int lane = threadIdx.x;
        unsigned long long next = start, last = gpu_now(), looks = 0;
        for (;;) {
            unsigned long long published = 0;
            int idle = 0;
            if (lane == 0) {  // one read of host memory a look (about 1 us): quit now and then
                published = queue[0];
                idle = published <= next &&
                       (gpu_now() - last >= idle_ns || (++looks % 64 == 0 && queue[3]));
            }
            published = __shfl_sync(~0u, published, 0);
            if (published > next) {
                // Into GPU memory, for the workers: reads of host memory cross PCIe one by
                // one (a worker's own read of its job there took 140 us in all)
                __threadfence();  // the jobs' words were stored before the count
                for (unsigned long long k = next; k < published; k++)
                    if (lane < STAND_JOB)
                        jobs[k % STAND_SLOTS * STAND_JOB + lane] =
                            queue[4 + k % STAND_SLOTS * STAND_JOB + lane];
                __threadfence();
                __syncwarp();
                if (lane == 0)
                    scratch[0] = published;
                next = published;
                last = gpu_now();
                continue;
            }
            if (!__shfl_sync(~0u, idle, 0))
                continue;
            int stay = 0;
            if (lane == 0) {
                queue[1] = STAND_LEAVING;
                __threadfence_system();
                stay = queue[0] > next;
                if (stay) {
                    queue[1] = STAND_RUNNING;
                } else {
                    queue[2] = next;
                    scratch[1] = epoch;  // the workers: leave once they took every job
                    __threadfence_system();
                    queue[1] = STAND_STOPPED;
                }
            }
            if (!__shfl_sync(~0u, stay, 0))
                return;
        }
    }
    __shared__ unsigned long long job[STAND_JOB];
    __shared__ int leave;
    unsigned int workers = gridDim.x - 1;
    for (unsigned long long mine = start;; mine++) {
        if (threadIdx.x == 0) {
            for (;;) {
                if (scratch[0] > mine) {
                    leave = 0;
                    break;
                }
                if (scratch[1] == epoch) {  // stored after the last hand-out: look again
                    __threadfence();
                    if (scratch[0] <= mine) {
                        leave = 1;
                        break;
                    }
                }
                __nanosleep(32);
            }
            __threadfence();
        }
        __syncthreads();
        if (leave)
            return;
        if (threadIdx.x < STAND_JOB)
            job[threadIdx.x] = jobs[mine % STAND_SLOTS * STAND_JOB + threadIdx.x];
        __syncthreads();
        for (unsigned long long w = blockIdx.x - 1; w < job[4] * job[7]; w += workers)
            ipc_chunk((const char *)job[0], (char *)job[1], (const unsigned long long *)job[2],
                      job[3], job[4], job[5], (int)job[6], chunk, job[7], w);
        __threadfence_system();  // as ipc_copy: every store seen everywhere, then the seq
        __syncthreads();
        unsigned long long *done = (unsigned long long *)scratch + 2 + mine % STAND_SLOTS;
        if (threadIdx.x == 0 && atomicAdd(done, 1) == workers - 1) {
            *done = 0;  // the host reuses the slot once it sees the seq
            __threadfence_system();
            if (job[8])
                *(volatile unsigned long long *)job[8] = job[9];
        }
    }
}

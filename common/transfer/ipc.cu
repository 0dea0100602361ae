// The transfer engine's CUDA IPC route (common/transfer/ipc.py): one command's copies,
// made by the GPU straight into a peer's memory on this host, then marked done in the
// peer's inbox (host memory its worker polls).
//
// table: the command's source items, then its destination items, then (with `lengths`)
// each copy's length; else every copy is `length` bytes. An item times `scale` is a
// byte offset (the host checked them all: common/transfer/copier.c). A copy is cut in
// `per_copy` chunks of `chunk` bytes (a multiple of 16), so that 100 pages of 64 KiB
// keep every SM busy; a block takes chunks in turn, 16 bytes a thread where it can.
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
    for (unsigned long long w = blockIdx.x; w < count * per_copy; w += gridDim.x) {
        unsigned long long p = w / per_copy, start = w % per_copy * chunk;
        unsigned long long n = lengths ? table[2 * count + p] : length;
        if (start >= n)
            continue;
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

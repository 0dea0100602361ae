#pragma once
// Device helpers any chapter's kernels use, whatever they move (cupy RawModule, with
// common.gpu.INCLUDE among its options): the GPU's clock, a block's sum, a row copied by a
// block, an index of either width, bf16 rounding. Chapter 17's kernels grew them; 17, 18
// and the transfer engine's CUDA IPC route (common/transfer/ipc.cu) include them.

// The GPU's global timer, in nanoseconds: the same clock on every SM, for timeouts and for
// stamps the host maps onto its own clock.
__device__ unsigned long long gpu_now()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The sum of `v` over the block's threads; every thread of the block calls it.
__device__ int block_sum(int v)
{
    __shared__ int warp_sum[32];
    for (int offset = 16; offset; offset >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    __syncthreads();  // warp_sum may still be read by a previous call
    if ((threadIdx.x & 31) == 0)
        warp_sum[threadIdx.x >> 5] = v;
    __syncthreads();
    int total = 0;
    for (int w = 0; w < (blockDim.x + 31) >> 5; w++)
        total += warp_sum[w];
    return total;
}

// A block copies one row; 16 bytes at a time when everything is 16-byte aligned. Loads
// bypass L1 (__ldcg): the row may have just been stored by a peer.
__device__ void copy_row(unsigned char *to, const unsigned char *from, long long bytes)
{
    if (((bytes | (long long)to | (long long)from) & 15) == 0) {
        for (long long i = threadIdx.x; i < bytes / 16; i += blockDim.x)
            ((uint4 *)to)[i] = __ldcg((const uint4 *)from + i);
    } else {
        for (long long i = threadIdx.x; i < bytes; i += blockDim.x)
            to[i] = __ldcg(from + i);
    }
}

// Indices as the caller has them, int32 or int64 (index_bytes 4 or 8): a conversion would
// cost a launch, and more host time than the kernel it feeds.
__device__ long long index_at(const void *indices, int index_bytes, long long i)
{
    return index_bytes == 8 ? ((const long long *)indices)[i] : ((const int *)indices)[i];
}

// float -> bf16 bits, rounded to nearest even, NaN kept: common/gpu/rounding.py's to_bf16.
__device__ unsigned short bf16_bits(float v)
{
    unsigned int bits = __float_as_uint(v);
    if (v != v)
        return 0x7FC0;
    return (unsigned short)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

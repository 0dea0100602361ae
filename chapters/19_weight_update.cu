// Chapter 19's kernels: fp8 weights in 128 x 128 blocks from a trainer's rows of a bf16
// tensor, with common/gpu/fp8.cuh's rounding and block maximum (what chapter 16 does in
// 1 x 128 blocks of float32). A trainer holds rows [first, first + rows) of the tensor;
// the block rows at its edges it shares with its neighbours, hence two kernels: the
// largest magnitude over its own rows of each block it touches (fp8_weight_amax), then,
// once the neighbours' maxima are in and the scales known, the codes (fp8_weight_codes).
#include "fp8.cuh"

__device__ float bf16_value(unsigned short h)
{
    return __uint_as_float((unsigned int)h << 16);
}

// grid (cols / 128, block rows touched), 128 threads, thread i column i of its block.
// amax[block row][block column], the block rows counted from the one row `first` is in.
extern "C" __global__ void fp8_weight_amax(const unsigned short *x, long long rows, int cols,
                                           long long first, float *amax)
{
    __shared__ float warp_max[4];
    int i = threadIdx.x;
    long long top = (first / 128 + blockIdx.y) * 128 - first;  // in x's rows; may be < 0
    long long end = min(top + 128, rows);
    float a = 0.0f;
    for (long long r = max(top, 0LL); r < end; r++)
        a = fmaxf(a, fabsf(bf16_value(x[r * cols + blockIdx.x * 128 + i])));
    a = block_max128(a, i, warp_max);
    if (i == 0)
        amax[(long long)blockIdx.y * gridDim.x + blockIdx.x] = a;
}

// grid (width / 128, rows), 128 threads: rows [0, rows) x columns [c0, c0 + width) of x
// into codes (rows x width, contiguous), each value divided by its block's scale
// (scales laid out as fp8_weight_amax's amax, `scale_cols` = cols / 128 to a row).
extern "C" __global__ void fp8_weight_codes(const unsigned short *x, int cols, long long first,
                                            const float *scales, int scale_cols, int c0,
                                            int width, unsigned char *codes)
{
    long long r = blockIdx.y;
    int c = blockIdx.x * 128 + threadIdx.x;
    float scale = scales[((first + r) / 128 - first / 128) * scale_cols + (c0 + c) / 128];
    codes[r * width + c] = fp8_e4m3(bf16_value(x[r * cols + c0 + c]) / scale);
}

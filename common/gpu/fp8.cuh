#pragma once
// fp8 e4m3 on the GPU, for the MoE chapters and chapter 19's weights (cupy RawModule: 17's
// and 19's kernels include it). Run on 2 x H200: its fp8 rows match common/gpu/rounding.py.
//
// fp8_quantize: one block of 128 threads per (token, block of 128 values). The
// block's largest magnitude sets its scale (amax / 448, or 1 when all are zero); each
// value becomes an e4m3 code, rounded to nearest even and saturated at +-448, exactly
// as common/gpu/rounding.py does in numpy (the checks compare bytes). The row is
// [hidden codes | hidden / 128 float32 scales].

__device__ unsigned char fp8_e4m3(float v)
{
    unsigned char sign = (__float_as_uint(v) >> 24) & 0x80;
    float a = fminf(fabsf(v), 448.0f);
    if (a < 0.015625f)  // below 2^-6: subnormal, a multiple of 2^-9 (code 8 is 2^-6)
        return sign | (unsigned char)__float2int_rn(a * 512.0f);
    unsigned int bits = __float_as_uint(a);
    bits += 0x7FFFF + ((bits >> 20) & 1);  // keep 3 mantissa bits, ties to even
    unsigned int exponent = (bits >> 23) - 127 + 7, mantissa = (bits >> 20) & 7;
    return sign | (unsigned char)(exponent << 3 | mantissa);
}

// The largest of `a` over the 128 threads of a block (i = 0..127), with 4 floats of shared
// memory. Every thread of the block calls it (it synchronises them, and again before
// returning, so that a loop may call it once more).
__device__ float block_max128(float a, int i, float *warp_max)
{
    for (int offset = 16; offset; offset >>= 1)
        a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, offset));
    if ((i & 31) == 0)
        warp_max[i >> 5] = a;
    __syncthreads();
    float amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
    __syncthreads();
    return amax;
}

// A block's scale from its largest magnitude, as common/gpu/rounding.py computes it.
__device__ float fp8_scale(float amax)
{
    return amax > 0.0f ? amax / 448.0f : 1.0f;
}

// One (token, block of 128 values), by 128 threads of a block (i = 0..127), with 4 floats
// of shared memory. Every thread of the block calls it (it synchronises them); `active`
// is false for threads with no group to do.
__device__ void fp8_quantize_group(const float *x, unsigned char *rows, int hidden,
                                   int row_bytes, int token, int block, int i, bool active,
                                   float *warp_max)
{
    float v = active ? x[(long long)token * hidden + block * 128 + i] : 0.0f;
    float scale = fp8_scale(block_max128(fabsf(v), i, warp_max));
    if (!active)
        return;
    unsigned char *row = rows + (long long)token * row_bytes;
    row[block * 128 + i] = fp8_e4m3(v / scale);
    if (i == 0)
        ((float *)(row + hidden))[block] = scale;
}

extern "C" __global__ void fp8_quantize(const float *x, unsigned char *rows, int hidden,
                                            int row_bytes)
{
    __shared__ float warp_max[4];
    fp8_quantize_group(x, rows, hidden, row_bytes, blockIdx.x, blockIdx.y, threadIdx.x, true,
                       warp_max);
}

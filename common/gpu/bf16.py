"""bf16 matrix products on a GPU, as a real prefill runs them.

A real prefill multiplies bf16 matrices on the GPU's tensor cores; cupy's float32 `@` does
not use them, and cupy has no bf16 dtype of its own. So bf16 values live as their bits in
uint16 and the product goes to cuBLAS directly: gemmEx, bf16 in, float32 accumulated and out.
"""
import functools

import numpy as np

CUDA_R_16BF, CUDA_R_32F = 14, 0  # cudaDataType (library_types.h); cupy 13 lacks the first
ONE, ZERO = np.ones(1, np.float32), np.zeros(1, np.float32)  # alpha, beta: host scalars
ROUND_BF16 = """
unsigned int bits = __float_as_uint(x);
h = x != x ? (unsigned short)0x7FC0
           : (unsigned short)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
"""  # to nearest, ties to even; NaN stays NaN: common/gpu/rounding.py's to_bf16, one pass


@functools.cache
def round_bf16():
    import cupy
    return cupy.ElementwiseKernel("float32 x", "uint16 h", ROUND_BF16, "tut_round_bf16")


def to_bf16(x):
    """float32 cupy array -> its bf16 bits (uint16, C-contiguous), rounded to nearest even."""
    return round_bf16()(x)


def gemm_bf16(a, b):
    """a[M, K] @ b[K, N] -> float32 [M, N] on the tensor cores: a and b bf16 bits (uint16,
    C-contiguous cupy arrays), products accumulated in float32. cuBLAS reads matrices
    column-major, where a row-major [M, N] is an [N, M]: it computes C^T = B^T A^T, so
    (N, M, K) with b first."""
    import cupy
    cublas = cupy.cuda.cublas
    (m, k), (kb, n) = a.shape, b.shape
    if k != kb or a.dtype != b.dtype or a.dtype != cupy.uint16 or \
            not (a.flags.c_contiguous and b.flags.c_contiguous):
        raise ValueError(f"gemm_bf16 wants C-contiguous uint16 [M, K] and [K, N], got "
                         f"{a.dtype}{a.shape} and {b.dtype}{b.shape}")
    c = cupy.empty((m, n), cupy.float32)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)  # cupy's default too
    cublas.gemmEx(handle, cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_N, n, m, k,
                  ONE.ctypes.data, b.data.ptr, CUDA_R_16BF, n,
                  a.data.ptr, CUDA_R_16BF, k,
                  ZERO.ctypes.data, c.data.ptr, CUDA_R_32F, n,
                  cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    return c

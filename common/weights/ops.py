"""Where chapter 19's quantisation runs: numpy on the host (the same arithmetic as the
kernels), or the kernels of chapters/19_weight_update.cu on the GPU; and the copy ceiling
of either path, measured in the same run.
"""
import time

import numpy as np

from common import bench
from common.fabric import memory
from common.gpu import INCLUDE
from common.gpu import rounding
from common.weights import BLOCK

class HostOps:
    """numpy stands in for the kernels of 19_weight_update.cu, the same arithmetic."""
    xp = np

    @staticmethod
    def amax(x, first, out):
        rows, cols = x.shape
        top, blocks = first % BLOCK, len(out) // (cols // BLOCK)
        padded = np.zeros((blocks * BLOCK, cols), np.float32)
        padded[top:top + rows] = np.abs(rounding.from_bf16(x))
        out[:] = padded.reshape(blocks, BLOCK, cols // BLOCK, BLOCK).max(axis=(1, 3)).ravel()

    @staticmethod
    def codes(x, first, scales, scale_cols, c0, width, out):
        block_rows = (first + np.arange(len(x))) // BLOCK - first // BLOCK
        s = scales[:(block_rows[-1] + 1) * scale_cols].reshape(-1, scale_cols)[block_rows]
        s = np.repeat(s[:, c0 // BLOCK:(c0 + width) // BLOCK], BLOCK, axis=1)
        out[:] = e4m3(rounding.from_bf16(x[:, c0:c0 + width]) / s).ravel()

    @staticmethod
    def sync():
        pass

    @staticmethod
    def copy_gbps(size):
        a, b = np.ones(size, np.uint8), np.zeros(size, np.uint8)
        return copy_rate(lambda: np.copyto(b, a), size, HostOps.sync)


def e4m3(v):
    """fp8.cuh's fp8_e4m3 in numpy, bit for bit: keep 3 mantissa bits, ties to even
    (8x the speed of rounding.to_e4m3's table search, which checks it)."""
    sign = ((v.view(np.uint32) >> 24) & 0x80).astype(np.uint8)
    a = np.minimum(np.abs(v), np.float32(rounding.FP8_MAX))
    bits = a.view(np.uint32)
    bits = bits + np.uint32(0x7FFFF) + ((bits >> 20) & 1)
    normal = ((bits >> 23) - 120) << 3 | ((bits >> 20) & 7)  # exponent - 127 + 7
    subnormal = np.rint(a * 512).astype(np.uint32)  # below 2^-6: multiples of 2^-9
    return np.where(a < 0.015625, subnormal, normal).astype(np.uint8) | sign


class CudaOps:
    """The kernels (`kernels`: chapter 19's .cu), on this GPU's current stream (cupy's)."""

    def __init__(self, gpu, kernels):
        self.xp = cp = memory.cupy()
        memory.use_gpu(gpu)
        module = cp.RawModule(code=open(kernels).read(), options=(INCLUDE,))
        self._amax = module.get_function("fp8_weight_amax")
        self._codes = module.get_function("fp8_weight_codes")

    def amax(self, x, first, out):
        rows, cols = x.shape
        self._amax((cols // BLOCK, out.size // (cols // BLOCK)), (BLOCK,),
                   (x, np.int64(rows), np.int32(cols), np.int64(first), out))

    def codes(self, x, first, scales, scale_cols, c0, width, out):
        self._codes((width // BLOCK, len(x)), (BLOCK,),
                    (x, np.int32(x.shape[1]), np.int64(first), scales, np.int32(scale_cols),
                     np.int32(c0), np.int32(width), out))

    def sync(self):
        self.xp.cuda.get_current_stream().synchronize()

    def copy_gbps(self, size):
        a, b = self.xp.ones(size, self.xp.uint8), self.xp.zeros(size, self.xp.uint8)
        return copy_rate(lambda: b.__setitem__(Ellipsis, a), size, self.sync)


def copy_rate(copy, size, sync):
    """The copy ceiling on this path, measured here: GB/s of the median of 5 copies."""
    copy()
    sync()
    took = []
    for _ in range(5):
        start = time.perf_counter()
        copy()
        sync()
        took.append(time.perf_counter() - start)
    return size / bench.median(took) / 1e9

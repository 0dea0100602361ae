"""Kernel launches at the CUDA driver's cost, for chapter 17's kernels.

cupy converts every argument on every launch: 10 us of host time for a kernel of 25
arguments on the 2 x H200 box's Xeon, against 4.4 us for cuLaunchKernel called through
cffi (the same empty kernel, 200 launches, median of 5 runs). An all-to-all half is a few
launches, and the GPU waits for each while the host prepares it. Here each argument has an
8-byte slot, set once when it does not change; a launch sets the few that do, by name, and
hands the driver the slots' addresses.
"""
import numpy as np

from common.gpu import cuda_driver
from common.gpu.cuda_driver import ffi


def _word(value):
    """An argument as the 64 bits of its slot: a device array's address, or a number
    (two's complement; the driver reads 4 bytes of it for an int, little-endian)."""
    data = getattr(value, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return data.ptr
    return int(value) & 0xFFFF_FFFF_FFFF_FFFF


class KernelCall:
    """One kernel of a cupy RawModule, its arguments named in the order of its signature:
    KernelCall(module.get_function("k"), stream, 256, a=buf, n=None), then k(blocks, n=5)."""

    def __init__(self, kernel, stream, threads, shared=0, **arguments):
        self.function = ffi.cast("void *", kernel.kernel.ptr)
        self.stream = ffi.cast("void *", stream.ptr)
        self.threads, self.shared = threads, shared
        self.launch = cuda_driver.function("cuLaunchKernel")
        self.slot = {name: i for i, name in enumerate(arguments)}
        self.slots = np.zeros(len(arguments), np.uint64)
        first = self.slots.ctypes.data
        self.params = ffi.new("void *[]", [ffi.cast("void *", first + 8 * i)
                                           for i in range(len(arguments))])
        self.set(**{k: v for k, v in arguments.items() if v is not None})

    def set(self, **values):
        for name, value in values.items():
            self.slots[self.slot[name]] = _word(value)

    def __call__(self, blocks, **values):
        """Launch on `blocks` blocks (or an (x, y) grid) after setting `values`."""
        self.set(**values)
        x, y = blocks if isinstance(blocks, tuple) else (blocks, 1)
        rc = self.launch(self.function, max(x, 1), y, 1, self.threads, 1, 1, self.shared,
                         self.stream, self.params, ffi.NULL)
        if rc:
            raise ValueError(f"cuLaunchKernel failed: {cuda_driver.error_name(rc)}")

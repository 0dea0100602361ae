"""Where the MoE chapters' all-to-all keeps its bytes, and what does its kernels' work.

HostMemory (--device cpu): host memory in /dev/shm files that the other ranks of the
node map, numpy for the kernels. CudaMemory (--device cuda): GPU memory that the node's
ranks map through CUDA IPC, cupy and CUDA kernels. Both offer the same few operations: a
region, a handle for node peers and the opening of theirs, a copy
into a peer's region, `ready` (queued work done) and `settle` (arrived data readable),
the fp8 quantisation, a copy to the host, and a clock.
"""
import ctypes
import mmap
import os
import time

import numpy as np

from common import launch
from common.fabric import memory
from common.gpu import INCLUDE
from common.gpu import rounding
from common.moe import reference as ref
from common.fabric import lib

SHM = "/dev/shm"
HERE = os.path.dirname(os.path.abspath(__file__))  # ring.h is beside this file


class Region:
    """Host memory in a /dev/shm file, which the other ranks of the node map."""

    def __init__(self, job, name, size):
        self.path = f"{SHM}/moe-{job}-{name}"
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                self.map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as e:
            self.unlink()
            raise ValueError(f"cannot make {size} bytes of shared memory in {SHM}: "
                             f"{e.strerror}") from None
        self.bytes = np.frombuffer(self.map, dtype=np.uint8)
        self.ptr = self.bytes.ctypes.data

    @staticmethod
    def peer(job, name, size):
        try:
            fd = os.open(f"{SHM}/moe-{job}-{name}", os.O_RDWR)
            try:
                return np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8)
            finally:
                os.close(fd)
        except OSError as e:
            raise launch.PeerGone(f"cannot map {name} of a peer ({e.strerror}): "
                                  "is it gone?") from None

    def unlink(self):
        """Once every peer has mapped it: nothing is left behind, whatever happens next."""
        if os.path.exists(self.path):
            os.unlink(self.path)


class HostMemory:
    """--device cpu: the data region in host memory, a /dev/shm file that the node's
    ranks map (as CUDA IPC maps a peer GPU's memory); numpy does the kernels' work."""
    xp, gpu, iface, device = np, None, lib.FI_HMEM_SYSTEM, 0

    def __init__(self, own, group, size):
        self.job, self.size = group.job, size
        self.region = Region(group.job, f"{group.rank}-data", size)
        own.callback(self.region.unlink)
        self.data = self.mine = self.region.bytes
        self.ptr = self.region.ptr

    def handle(self):
        return b""  # its name, known to all, is how node peers find it

    def open(self, own, rank, handle):
        return Region.peer(self.job, f"{rank}-data", self.size)

    def published(self):
        self.region.unlink()

    def copy(self, peer, remote, local, length):
        peer[remote:remote + length] = self.data[local:local + length]

    def ready(self):
        """Wait until what was queued (kernels, copies to peers) is done: then a stamp may
        announce it and the proxy may send it. numpy queues nothing; the stamps' own
        release and acquire order the bytes around them."""

    def settle(self):
        """A stamp was seen: make what it announces readable here."""

    def quantize_fp8(self, x):
        return ref.wire_rows("fp8", x)

    def host_shared(self, nbytes):
        """Host memory that this rank's device side (numpy here) and its proxy share."""
        return np.zeros(nbytes, np.uint8)

    def host(self, array):
        return array

    def mark(self):
        return time.perf_counter()

    def seconds(self, start, end):
        return end - start


class CudaMemory:
    """--device cuda: the data region in GPU memory, straight from cudaMalloc (CUDA IPC
    hands out whole allocations) so that the node's ranks can map it; cupy and kernels
    (common/gpu/fp8.cuh's, and a chapter's) do the work. Run on 2 x H200 (see ready())."""
    iface = lib.FI_HMEM_CUDA

    def __init__(self, own, group, size, kernels=None, blocking=True):
        """size 0: no region, only the GPU, its stream and kernels (for the NCCL baseline).
        `kernels`: the path of a chapter's CUDA source, which may #include "fp8.cuh"
        (None: the fp8 kernel alone). blocking=False: a stream that does not wait for
        CUDA's legacy one (see below)."""
        cp = self.xp = memory.cupy()
        self.size, self.rt = size, cp.cuda.runtime
        count = self.rt.getDeviceCount()
        self.gpu = self.device = group.gpu if group.gpu is not None else group.rank % count
        memory.use_gpu(self.gpu)
        if size:
            # whole host pages: a dmabuf of the region covers them (cuda_driver.dmabuf)
            page = os.sysconf("SC_PAGE_SIZE")
            self.ptr = self.mine = self.rt.malloc(-(-size // page) * page)
            own.callback(self.rt.free, self.ptr)
            self.rt.memset(self.ptr, 0, size)
            self.data = cp.ndarray((size,), cp.uint8, cp.cuda.MemoryPointer(
                cp.cuda.UnownedMemory(self.ptr, size, self, self.gpu), 0))
        # A blocking stream: it waits for work on CUDA's legacy default stream, and that
        # waits for it. Our own copies from host arrays and libfabric's copies (shm, from
        # the proxy thread) are ordered with our kernels without asking. With a
        # non-blocking stream the NCCL baseline read counts that had not landed yet
        # (garbage in its second check on 2 x H200, every run; right under
        # CUDA_LAUNCH_BLOCKING=1).
        self.stream = cp.cuda.Stream(non_blocking=not blocking)
        self.stream.use()  # this rank's cupy work, kernels and copies all go here
        self.marks, self.marked = [cp.cuda.Event() for _ in range(8)], 0
        code = open(kernels).read() if kernels else '#include "fp8.cuh"\n'
        self.module = cp.RawModule(code=code, options=("-I" + HERE, INCLUDE))
        self.quantize = self.module.get_function("fp8_quantize")

    def handle(self):
        return bytes(self.rt.ipcGetMemHandle(self.ptr))

    def open(self, own, rank, handle):
        ptr = self.rt.ipcOpenMemHandle(handle)
        own.callback(self.rt.ipcCloseMemHandle, ptr)
        return ptr

    def published(self):
        pass

    def copy(self, peer, remote, local, length):
        # offsets may be numpy integers; cupy's runtime takes Python ints only
        self.rt.memcpyAsync(int(peer + remote), int(self.ptr + local), int(length),
                            self.rt.memcpyDefault, self.stream.ptr)

    def ready(self):
        # The whole device, not our stream alone: with only the stream (then a non-blocking
        # one), 4 host-driven ranks on two emulated nodes got wrong combine sums (every
        # run; right with CUDA_LAUNCH_BLOCKING=1, and right with this). libfabric's own
        # copies run from the proxy thread; which of them raced is not pinned down.
        self.rt.deviceSynchronize()

    def settle(self):
        # Chapter 07's lesson: shm's CUDA IPC copies into our memory may still be running
        # when the immediate arrives; waiting for the device covers them.
        self.rt.deviceSynchronize()

    def legacy_stream_sync(self):
        """The address of cudaStreamSynchronize in the CUDA runtime libfabric loads, for
        the proxy's thread (C, no GIL) to wait on CUDA's legacy stream (NULL), where shm
        makes its copies."""
        try:
            cudart = ctypes.CDLL("libcudart.so")
        except OSError as e:
            raise ValueError(f"cannot load the CUDA runtime libfabric uses: {e}") from None
        return ctypes.cast(cudart.cudaStreamSynchronize, ctypes.c_void_p).value

    def host_shared(self, nbytes):
        """Host memory that this rank's kernels and its proxy share: pinned, so mapped
        for the GPU at the same address."""
        import cupyx
        return cupyx.zeros_pinned(nbytes, np.uint8)

    def quantize_fp8(self, x):
        """float32 tokens -> fp8 rows."""
        cp = self.xp
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, hidden = x.shape
        row = hidden + hidden // rounding.FP8_BLOCK * 4
        rows = cp.empty((n, row), cp.uint8)
        if n:
            self.quantize((n, hidden // rounding.FP8_BLOCK), (rounding.FP8_BLOCK,),
                          (x, rows, np.int32(hidden), np.int32(row)))
        return rows

    def host(self, array):
        return self.xp.asnumpy(array)  # host arrays as they are

    def mark(self):
        """An event recorded on our stream, from a ring made once (making one costs more
        than recording it): valid until len(self.marks) more are taken."""
        event = self.marks[self.marked % len(self.marks)]
        self.marked += 1
        event.record(self.stream)
        return event

    def seconds(self, start, end):
        end.synchronize()
        return self.xp.cuda.get_elapsed_time(start, end) / 1e3


DEVICES = {"cpu": HostMemory, "cuda": CudaMemory}

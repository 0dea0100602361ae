"""The few CUDA driver calls we make ourselves, loaded at run time (no CUDA toolkit to build).

libcuda.so.1 comes with the NVIDIA driver, so it is there wherever a GPU is, and loaded
already where cupy runs. The calls: cuLaunchKernel (common/gpu/kernel_call.py; with
cuMemcpyHtoDAsync and an event between two streams, from C: common/transfer/copier.c),
the batched copy the CUDA IPC route is measured against (cuMemcpyBatchAsync, CUDA
12.8's: common/baselines.py), a dmabuf fd for a range of GPU memory and whether the
thread has the current context its export needs (registration by dmabuf,
common/fabric/memory.py), where an allocation starts (CUDA IPC, common/transfer/ipc.py),
and what chapter 16's proxy and the transfer engine need before they tell a GPU that a
NIC's WRITE has landed in its memory (flush_scope: the device's GPUDirect RDMA write
ordering, and the flush where it falls short). Numbers are cuda.h's.
"""
import os

import cffi

ffi = cffi.FFI()
ffi.cdef("""
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shared, void *stream, void **params, void **extra);
int cuMemGetHandleForAddressRange(void *handle, unsigned long long dptr, size_t size,
                                  int handle_type, unsigned long long flags);
int cuInit(unsigned flags);
int cuDeviceGetAttribute(int *value, int attribute, int device);
int cuFlushGPUDirectRDMAWrites(int target, int scope);
int cuGetErrorName(int error, const char **name);
int cuCtxGetCurrent(void **ctx);
int cuCtxSetCurrent(void *ctx);
int cuMemGetAddressRange_v2(unsigned long long *base, size_t *size, unsigned long long dptr);
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t bytes, void *stream);
int cuEventRecord(void *event, void *stream);
int cuStreamWaitEvent(void *stream, void *event, unsigned flags);
struct cu_memcpy_attributes {  // CUmemcpyAttributes: an order, two CUmemLocations, flags
    int src_access_order, src_type, src_id, dst_type, dst_id;
    unsigned flags;
};
int cuMemcpyBatchAsync_v2(unsigned long long *dsts, unsigned long long *srcs, size_t *sizes,
                          size_t count, struct cu_memcpy_attributes *attrs, size_t *indices,
                          size_t attrs_count, void *stream);
""")
DMA_BUF_FD = 1                 # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
IN_STREAM_ORDER = 1            # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
ON_DEVICE = 1                  # CU_MEM_LOCATION_TYPE_DEVICE
WRITES_ORDERING = 118          # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING
DMA_BUF_SUPPORTED = 124        # CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
FLUSH_OPTIONS = 117            # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
FLUSH_OPTION_HOST = 1          # CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST: the call works
TARGET_CURRENT_CTX = 0         # CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX
# CUGPUDirectRDMAWritesOrdering and CUflushGPUDirectRDMAWritesScope share these values:
# a wider scope is a larger number.
NONE, OWNER, ALL_DEVICES = 0, 100, 200
SCOPES = {NONE: "none", OWNER: "owner", ALL_DEVICES: "all devices"}
_loaded = []


def driver():
    """libcuda.so.1 (ValueError, one line, where there is none)."""
    if not _loaded:
        try:
            _loaded.append(ffi.dlopen("libcuda.so.1"))
        except OSError as e:
            why = str(e).partition(".  Additionally")[0]  # cffi adds what ctypes tried
            raise ValueError(f"cannot load the CUDA driver: {why}") from None
    return _loaded[0]


def function(name):
    """A driver function, or ValueError saying the driver is too old to have it."""
    try:
        return getattr(driver(), name)
    except (AttributeError, NotImplementedError):
        raise ValueError(f"the CUDA driver has no {name} (too old)") from None


def address(function):
    """Where a driver function is, for C that calls it (common/transfer/copier.c)."""
    return int(ffi.cast("uintptr_t", function))


def error_name(rc):
    name = ffi.new("const char **")
    if function("cuGetErrorName")(rc, name) or name[0] == ffi.NULL:
        return f"CUDA error {rc}"
    return ffi.string(name[0]).decode()


def check(call, rc):
    if rc:
        raise ValueError(f"{call}: {error_name(rc)}")


def dmabuf(ptr, size):
    """(fd, offset): a dmabuf fd for the host pages around [ptr, ptr + size) of GPU memory
    and where `ptr` lies in it. The driver wants the range aligned to host pages; the
    caller closes the fd. ValueError, saying why, where the driver gives none."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = ptr - ptr % page
    length = -(-(ptr + size - start) // page) * page
    fd = ffi.new("int *", -1)
    check("cuMemGetHandleForAddressRange", function("cuMemGetHandleForAddressRange")(
        fd, start, length, DMA_BUF_FD, 0))
    return fd[0], ptr - start


def allocation_base(ptr):
    """Where the allocation holding GPU address `ptr` starts: what a CUDA IPC handle names
    (an allocator's array is often a piece of a larger one)."""
    base, size = ffi.new("unsigned long long *"), ffi.new("size_t *")
    check("cuMemGetAddressRange", function("cuMemGetAddressRange_v2")(base, size, ptr))
    return base[0]


def attribute(which, device):
    check("cuInit", function("cuInit")(0))  # a no-op once cupy (or anyone) has done it
    value = ffi.new("int *")
    check("cuDeviceGetAttribute", function("cuDeviceGetAttribute")(value, which, device))
    return value[0]


def current_context():
    """Whether the calling thread has a current CUDA context (cuCtxGetCurrent). The dmabuf
    export needs one: without it the driver answers CUDA_ERROR_INVALID_CONTEXT. A new thread
    has none until it calls cudaSetDevice (CUDA 12 on) or cuCtxSetCurrent."""
    check("cuInit", function("cuInit")(0))
    ctx = ffi.new("void **")
    check("cuCtxGetCurrent", function("cuCtxGetCurrent")(ctx))
    return ctx[0] != ffi.NULL


def flush_address():
    """The address of cuFlushGPUDirectRDMAWrites, for C code to call without the GIL."""
    return int(ffi.cast("uintptr_t", function("cuFlushGPUDirectRDMAWrites")))


def flush(scope):
    """cuFlushGPUDirectRDMAWrites on the calling thread's current context, to `scope`: its
    CUresult (0: the NIC's writes that completed before are visible to that scope)."""
    return function("cuFlushGPUDirectRDMAWrites")(TARGET_CURRENT_CTX, scope)


# Providers that copy the bytes themselves, with the CPU or with CUDA copies
# (src/hmem_cuda.c, cuda_copy_to_dev; shm's CUDA IPC: prov/shm/src/smr_progress.c): no NIC
# writes into GPU memory behind the GPU's back.
COPYING_PROVIDERS = {"shm", "sm2", "tcp", "udp", "sockets", "net"}


def flush_scope(provider, gpu, attribute=attribute):
    """The scope to flush a NIC's GPUDirect RDMA writes into GPU `gpu` to before the GPU
    reads what they wrote (chapter 16's stamps, the transfer engine's expect); None when
    there is nothing to flush. Only a NIC writes into GPU memory by itself, and what reads
    it next is the GPU that owns it (its kernels, or the copies the host asks of it):
    covered where the device orders such writes for their owner at least
    (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING; "owner" on the H200s). NCCL
    asks the same. ValueError, one line, for a device that neither orders nor can flush.
    `attribute(which, gpu)`: this module's, or a test's."""
    if gpu is None or provider.split(";")[0] in COPYING_PROVIDERS:
        return None
    if attribute(WRITES_ORDERING, gpu) >= OWNER:
        return None
    if not attribute(FLUSH_OPTIONS, gpu) & FLUSH_OPTION_HOST:
        raise ValueError(f"GPU {gpu} neither orders GPUDirect RDMA writes nor can flush them "
                         "(cuFlushGPUDirectRDMAWrites): its reads could run ahead of a NIC's "
                         "writes")
    return OWNER

"""Buffers for RDMA: page-aligned host memory, or GPU memory through cupy.

A Buffer knows what libfabric needs to register it (address, size, iface,
device) and how to get its bytes back to the host for checking.
"""
import os

import numpy as np

from common.gpu import cuda_driver
import common.fabric as fi
from common.fabric import lib

PAGE = 4096
# The access a WRITE's target is registered with. FI_READ too: an EFA device with RDMA
# read but no RDMA write emulates a large WRITE by having the target READ the data into
# it (prov/efa/src/rdm/efa_rdm_pke_rtw.c), and only access beyond what EFA knows makes
# efa_mr.c grant the local write that READ needs (FI_REMOTE_WRITE alone does not
# there). verbs adds local write to remote write anyway (prov/verbs/src/verbs_mr.c).
WRITE_TARGET = lib.FI_REMOTE_WRITE | lib.FI_READ


class Buffer:
    def __init__(self, size, gpu=None):
        self.size, self.gpu = size, gpu
        try:  # numpy's and cupy's out-of-memory errors are both MemoryErrors
            if gpu is None:
                raw = np.zeros(size + PAGE, dtype=np.uint8)
                start = -raw.ctypes.data % PAGE  # align: some NICs register whole pages
                self.array = raw[start:start + size]
            else:
                cp = cupy()
                with cp.cuda.Device(gpu):
                    self.array = cp.zeros(size, dtype=cp.uint8)
        except MemoryError:
            raise ValueError(f"cannot allocate {size} bytes of {self.kind}") from None
        if gpu is None:
            self.ptr = self.array.ctypes.data
            self.iface, self.device = lib.FI_HMEM_SYSTEM, 0
        else:
            self.ptr = self.array.data.ptr
            self.iface, self.device = lib.FI_HMEM_CUDA, gpu

    @property
    def kind(self):
        return "host memory" if self.gpu is None else f"GPU {self.gpu} memory (cuda)"

    def write(self, offset, data):
        """Copy host bytes (a numpy uint8 array) into the buffer at `offset`."""
        if self.gpu is None:
            self.array[offset:offset + len(data)] = data
        else:
            with cupy().cuda.Device(self.gpu):
                self.array[offset:offset + len(data)].set(data)

    def read(self, offset, size):
        """The bytes at `offset`, as a host numpy array."""
        view = self.array[offset:offset + size]
        return view.copy() if self.gpu is None else view.get()


def register(own, domain, buf, access, key):
    """fi_mr_regattr with the buffer's iface; GPU memory by dmabuf where it can be.

    GPU buffers are flagged FI_HMEM_DEVICE_ONLY (cudaMalloc'd, never managed
    memory): without it, shm will not hand them to CUDA IPC and copies them in
    small pieces through host memory, some 100x slower over NVLink. Which way
    GPU memory was registered is said once per run.
    """
    if buf.gpu is None:
        return own(fi.mr_reg(domain, buf.ptr, buf.size, access, key))
    mr, how = register_device(domain, buf.ptr, buf.size, access, key, buf.iface, buf.device)
    if how not in _said:
        _said.add(how)
        print(how, flush=True)
    return own(mr)


_said = set()


def register_device(domain, ptr, size, access, key, iface, device, handle=None):
    """(mr, how): device memory registered as a dmabuf, else by its address; `how` says
    which, and why not by dmabuf. `handle(ptr, size)` -> (fd, offset) is the driver's
    dmabuf export (default: CUDA's, cuda_driver.dmabuf).

    EFA registers device memory through dmabuf only when asked (FI_MR_DMABUF);
    by address it calls ibv_reg_mr on it, which needs the nvidia_peermem kernel
    module (prov/efa/src/efa_mr.c). verbs tries dmabuf itself either way
    (prov/verbs/src/verbs_mr.c); shm and tcp turn a dmabuf back into its address
    (prov/util/src/util_mr_map.c). None of them keeps the fd: ibv_reg_dmabuf_mr
    takes the kernel's own reference, so it is closed once registered. efa's RDM fabric
    registers GPU memory its device cannot reach too, under a made-up key
    (rdm/efa_rdm_mr.c): what is said here is true there because fi.open_endpoint has
    stopped the run on such a device first (fi.require_gpudirect).
    """
    flags = 0 if iface == lib.FI_HMEM_SYSTEM else lib.FI_HMEM_DEVICE_ONLY
    why = dmabuf_missing(fi.mr_mode(domain))
    if why is None:
        try:
            fd, offset = (handle or cuda_driver.dmabuf)(ptr, size)
        except ValueError as e:
            why = str(e)
        else:
            try:
                return (fi.mr_reg(domain, ptr, size, access, key, iface, device, flags,
                                  dmabuf=(fd, offset)), "GPU memory registered by dmabuf")
            except fi.FabricError as e:
                why = f"{e} with FI_MR_DMABUF"
            finally:
                os.close(fd)
    try:
        mr = fi.mr_reg(domain, ptr, size, access, key, iface, device, flags)
    except fi.FabricError as e:
        if e.rc == -lib.FI_ENOSYS:  # efa_mr.c, verbs_mr.c, util_mr_map.c: no such iface
            raise ValueError(f"this libfabric was built without CUDA ({e}): build one with "
                             "scripts/build_libfabric.sh and set LIBFABRIC_PREFIX (on AWS: "
                             "the EFA installer's, LIBFABRIC_PREFIX=/opt/amazon/efa)") from None
        raise ValueError(f"cannot register GPU memory by address ({e}): that needs the "
                         f"nvidia_peermem kernel module (sudo modprobe nvidia_peermem); "
                         f"by dmabuf: {why}") from None
    return mr, f"GPU memory registered by address (no dmabuf: {why})"


def dmabuf_missing(mr_mode):
    """None when memory can be registered by dmabuf on a domain of `mr_mode`, else why not."""
    if not lib.tut_has_dmabuf():
        return (f"built against libfabric {lib.FI_MAJOR_VERSION}.{lib.FI_MINOR_VERSION}; "
                "FI_MR_DMABUF came in 1.20")
    if not mr_mode & lib.FI_MR_VIRT_ADDR:
        # ofi_mr_map_insert (prov/util/src/util_mr_map.c, 2.1.0) takes the base of an
        # offset-addressed registration from attr->mr_iov, which for a dmabuf is the
        # dmabuf: every WRITE into it (tcp, on 2.1.0) misses
        return ("the provider addresses memory by offset (no FI_MR_VIRT_ADDR), where "
                "libfabric's util MR map misreads a dmabuf")
    return None


def cupy():
    try:
        import cupy as cp
    except ImportError:
        raise ValueError("GPU memory needs cupy (pip install cupy-cuda12x or cupy-cuda13x)") from None
    return cp


def use_gpu(gpu):
    """Make GPU `gpu` this process's current device (ValueError, one line, if there is none).

    libfabric's own CUDA calls (shm's CUDA IPC copies, for one) run on the
    current device: left at GPU 0, a copy into GPU 1 takes a slow path.
    """
    if gpu is None:
        return
    cp = cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:
        count = 0
    if not 0 <= gpu < count:
        raise ValueError(f"no GPU {gpu} here ({count} found)")
    cp.cuda.runtime.setDevice(gpu)


def current(gpu):
    """Make GPU `gpu` (None: leave it) the current device of the calling thread.

    libfabric (2.1) finds a GPU buffer's allocation, for shm's CUDA IPC, in
    the thread's current CUDA context: a WRITE from GPU 1's memory posted
    while GPU 0 is current fails that lookup and falls back to copies staged
    through host memory, ~70x slower (chapter 09 on two H200s: 23 vs 1634
    Gbps). So a thread that serves several GPUs switches before each one's
    operations (a cheap call), and a thread per GPU switches once.
    """
    if gpu is not None:
        cupy().cuda.runtime.setDevice(gpu)


def synchronize(gpu):
    """Wait until GPU `gpu` has finished all its work, copies made for libfabric included."""
    if gpu is not None:
        with cupy().cuda.Device(gpu):
            cupy().cuda.runtime.deviceSynchronize()


def seeded_source(pages, page_size, seed, gpu=None, each=None):
    """A Buffer holding, in slot j, the seeded content of page pages[j]: what a writer
    sends. `each()` runs after every page (generating can take seconds)."""
    source = Buffer(page_size * len(pages), gpu)
    for j, page in enumerate(pages):
        source.write(j * page_size, seeded_page(seed, page, page_size))
        if each:
            each()
    return source


def count_wrong(buffers, page_size, seed, pages):
    """Bytes that differ from the seeded content, over `pages` of equal-sized `buffers`."""
    per_buffer = buffers[0].size // page_size
    return sum(int(np.count_nonzero(
        buffers[p // per_buffer].read((p % per_buffer) * page_size, page_size)
        != seeded_page(seed, p, page_size))) for p in pages)


def seeded_page(seed, page, size):
    """The content of page `page` for `seed`: both sides compute it, so it can be checked."""
    return np.random.default_rng([seed, page]).integers(0, 256, size, dtype=np.uint8)

"""The transfer engine's route inside a host: GPU to GPU by CUDA IPC, no NIC.

A NIC is the wrong path between two processes of one host whose pages are both in GPU
memory: libfabric's shm copies each WRITE on its own (a CUDA IPC copy per operation),
while one kernel copies thousands of pages at the GPU's memory speed (over NVLink between
two GPUs, or within one). So an engine made for a GPU exports its regions by CUDA IPC (a
handle in Region.descriptor()) and keeps an inbox, host memory shared with the peers of
its host (a memfd they open as /proc/<pid>/fd/<n>: nothing in /dev/shm to leave behind).
A writer whose peer is on this host (same boot, same pid namespace) and whose GPU can
reach the peer's sends each command to it as one kernel (ipc.cu): the command's offsets
copied to the GPU, the pages copied into the peer's memory, then, after a system-wide
fence, the command's sequence number stored into the writer's ring in the peer's inbox.
The peer's C worker polls its inbox and counts the command's immediates in the same table
as a NIC's (worker.c, tx_inbox_poll): expect() does not know which route they took.

The contract is the libfabric route's: write_pages, write_list, scatter and the rest,
completion by immediate counts, in any order. A peer that dies is seen as on libfabric:
its inbox stops taking commands (the ring of RECORDS fills: the engine's timeout) or its
pages stop coming (expect's timeout); the memory a dead exporter shared stays mapped, so
the survivor's CUDA context stays usable (tried on an H200: a kernel writing into a
SIGKILLed peer's region, then a new allocation, both without error).
"""
import collections
import mmap
import os
import struct
import uuid

import numpy as np

from common.fabric import cuda_driver, memory

WRITERS, RECORDS = 32, 1024    # writer rings in an inbox; commands in flight per writer
MAGIC = b"TXIPC01\0"
THREADS, CHUNK = 256, 8192     # a block's threads, bytes a block copies before it moves on
BLOCKS_PER_SM = 16
STAGING = 1 << 22              # bytes of each of the two rings that carry tables to the GPU
# In an engine's address: this host (boot id, pid namespace), the inbox (pid, fd) and the
# GPU (its PCI bus id, which names it whatever CUDA_VISIBLE_DEVICES says)
HOST = struct.Struct("<16sQII16s")
# In a region's descriptor: the allocation's IPC handle, the region's offset in it, its pid
HANDLE = struct.Struct("<4s64sQI")
MAGIC_HANDLE = b"IPC1"
HOST_MAPPED = 2                # cudaHostRegisterMapped
LAZY_PEER_ACCESS = 1           # cudaIpcMemLazyEnablePeerAccess
TO_DEVICE = 1                  # cudaMemcpyHostToDevice
KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ipc.cu")


def this_host():
    """(boot id, pid namespace): two processes with the same can reach each other's memfds
    and CUDA IPC handles; None where /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = uuid.UUID(f.read().strip()).bytes
        return boot, os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return None


def bus_id(gpu):
    return memory.cupy().cuda.runtime.deviceGetPCIBusId(gpu)


def inbox_size():
    return 64 + WRITERS * 64 + WRITERS * RECORDS * 32  # struct tx_inbox, its slots, records


class Inbox:
    """Ours: where peers of this host say which of their commands into our memory are
    done. Its address goes in Engine.address(); the worker polls it."""

    def __init__(self, own, ffi, bus):
        host = this_host()
        if host is None:
            raise OSError("no boot id or pid namespace in /proc")
        self.fd = os.memfd_create("transfer-inbox", os.MFD_CLOEXEC)
        own.callback(os.close, self.fd)
        os.ftruncate(self.fd, inbox_size())
        self.map = mmap.mmap(self.fd, inbox_size())
        own.callback(self.map.close)
        self.box = ffi.cast("struct tx_inbox *", ffi.from_buffer(self.map))
        own.callback(self.__dict__.pop, "box")  # no view left: mmap.close needs that
        ffi.memmove(self.box.magic, MAGIC, len(MAGIC))
        self.box.writers, self.box.records = WRITERS, RECORDS
        self.address = HOST.pack(*host, os.getpid(), self.fd, bus.encode())


def export(ptr):
    """The descriptor's trailer for GPU memory at `ptr`: its allocation's IPC handle and
    where `ptr` lies in it; None where CUDA cannot share it (memory from a stream-ordered
    pool, for one), which leaves that region to libfabric."""
    rt = memory.cupy().cuda.runtime
    try:
        base = cuda_driver.allocation_base(ptr)
        handle = rt.ipcGetMemHandle(base)
    except Exception:
        return None
    return HANDLE.pack(MAGIC_HANDLE, bytes(handle), ptr - base, os.getpid())


def parse_handle(trailer):
    """(handle, offset, pid) of a descriptor's trailer, or ValueError."""
    magic, handle, offset, pid = HANDLE.unpack(trailer)
    if magic != MAGIC_HANDLE:
        raise ValueError("not a CUDA IPC handle")
    return handle, offset, pid


class Routes:
    """An engine's side as a writer: the kernel, the stream its commands run on in order
    (one block counter serves them all) and a Route per peer of this host."""

    def __init__(self, engine, ffi):
        cp = memory.cupy()
        self.engine, self.ffi, self.cp = engine, ffi, cp
        self.host = this_host()

    def route(self, own, peer_host):
        """A Route to the peer whose address carried `peer_host` (HOST), or (None, why)."""
        boot, namespace, pid, fd, bus = HOST.unpack(peer_host)
        if self.host != (boot, namespace):
            return None, "another host"
        gpu, cp = self.engine.gpu, self.cp
        rt = cp.cuda.runtime
        bus = bus.rstrip(b"\0").decode()
        try:
            theirs = rt.deviceGetByPCIBusId(bus)
        except Exception:
            return None, f"their GPU ({bus}) is not visible here"
        if theirs != gpu and not rt.deviceCanAccessPeer(gpu, theirs):
            return None, f"GPU {gpu} cannot access GPU {theirs} (no peer access)"
        try:
            route = Route(own, self, pid, fd)
        except OSError as e:
            return None, f"their inbox cannot be opened ({e.strerror})"
        return route, f"CUDA IPC, GPU {gpu} -> GPU {theirs}"

    def start(self, own):
        """The kernel and its stream, made once a first peer is on this host."""
        if not hasattr(self, "copier"):
            self.copier = Copier(self.engine.gpu)
            self.stream = self.copier.stream
            own.callback(self.stream.synchronize)  # before the regions it copies go


class Copier:
    """ipc.cu's kernel on a stream of its own, on GPU `gpu` (the ceiling a benchmark
    compares the route with launches the same one: common/baselines.gather_ceiling), and
    the rings that carry each command's table to it: one in pinned host memory, where
    the host writes it, one on the GPU, where an upload on the same stream puts it, both
    allocated once (an allocation of each per command took tens of microseconds)."""

    def __init__(self, gpu):
        from common.moe.kernel_call import KernelCall
        cp = memory.cupy()
        memory.current(gpu)
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.blocks_done = cp.zeros(1, cp.uint32)  # one: the stream runs one kernel at a time
        kernel = cp.RawModule(code=open(KERNELS).read()).get_function("ipc_copy")
        self.call = KernelCall(kernel, self.stream, THREADS, src=None, dst=None, table=None,
                               count=None, length=None, lengths=None, chunk=CHUNK,
                               per_copy=None, seq_at=None, seq=None,
                               blocks_done=self.blocks_done)
        sms = cp.cuda.runtime.getDeviceProperties(gpu)["multiProcessorCount"]
        self.max_blocks = BLOCKS_PER_SM * sms
        self._pinned = cp.cuda.alloc_pinned_memory(STAGING)
        self.host = np.frombuffer(self._pinned, np.uint64, STAGING // 8)
        self.device = cp.cuda.alloc(STAGING)
        self.head = 0                     # the ring's next free entry
        self.spans = collections.deque()  # (start, done) of the tables in the rings, oldest first
        self.large = []                   # (done, memory) of tables too large for them
        self.upload = cp.cuda.runtime.memcpyAsync

    def __call__(self, src, dst, table, count, length, lengths, seq_at, seq):
        """Copy `count` pieces (table: a device address, as ipc.cu reads it) from address
        `src` to `dst`, then store `seq` at host address `seq_at`."""
        per_copy = -(-(int(lengths.max()) if lengths is not None else length) // CHUNK)
        self.call(min(count * per_copy, self.max_blocks), src=src, dst=dst, table=table,
                  count=count, length=0 if lengths is not None else length,
                  lengths=int(lengths is not None), per_copy=per_copy, seq_at=seq_at, seq=seq)

    def stage(self, parts, done, wait):
        """The device address of a table made of `parts` (uint64 arrays, one after the
        other), uploaded on the kernel's stream from the rings' next free span; `done()`
        says when the kernel that reads it has run, which frees the span. `wait(ready,
        why)` waits for room (the engine's _until). A table larger than a ring gets memory
        of its own."""
        n = sum(len(p) for p in parts)
        self.large = [x for x in self.large if not x[0]()]
        if n > len(self.host):
            address, keep = self.table(np.concatenate(parts))
            self.large.append((done, keep))
            return address
        if n == 0:
            return self.device.ptr  # nothing to read: the kernel only stores its mark
        start = self._room(n)
        if start is None:
            wait(lambda: self._room(n) is not None,
                 lambda: f"room for a table of {n} entries in the staging ring")
            start = self._room(n)
        np.concatenate(parts, out=self.host[start:start + n])
        self.head = start + n
        self.spans.append((start, done))
        self.upload(self.device.ptr + 8 * start, self.host.ctypes.data + 8 * start, 8 * n,
                    TO_DEVICE, self.stream.ptr)
        return self.device.ptr + 8 * start

    def _room(self, n):
        """Where a table of `n` entries fits now (the spans of finished kernels freed), or
        None. Spans are taken in order around the ring (a table that does not fit before
        its end starts again at 0), so those in use run from the oldest's start up to head:
        head equal to that start means the ring is full."""
        while self.spans and self.spans[0][1]():
            self.spans.popleft()
        if not self.spans:
            return 0
        oldest = self.spans[0][0]
        if self.head > oldest:  # in use: [oldest, head)
            if self.head + n <= len(self.host):
                return self.head
            return 0 if n <= oldest else None
        return self.head if self.head + n <= oldest else None  # in use: all but [head, oldest)

    def table(self, pieces):
        """(device address, what to keep until the kernel ran) of a table (uint64 numpy)
        in memory of its own, copied there from pinned memory on the kernel's stream."""
        cp = memory.cupy()
        pinned = cp.cuda.alloc_pinned_memory(pieces.nbytes)
        staged = np.frombuffer(pinned, np.uint64, len(pieces))
        staged[:] = pieces
        device = cp.cuda.alloc(pieces.nbytes)
        self.upload(device.ptr, staged.ctypes.data, pieces.nbytes, TO_DEVICE, self.stream.ptr)
        return device.ptr, (pinned, device)


class Route:
    """The writer's CUDA IPC route to one peer of this host: its inbox mapped here (and
    for the GPU, whose kernel stores each command's seq into it), a ring of it ours."""

    def __init__(self, own, routes, pid, fd):
        ffi, cp = routes.ffi, routes.cp
        self.routes = routes
        at = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
        try:
            self.map = mmap.mmap(at, inbox_size())
        finally:
            os.close(at)
        own.callback(self.map.close)
        box = ffi.cast("struct tx_inbox *", ffi.from_buffer(self.map))
        own.callback(self.__dict__.clear)  # no view left: mmap.close needs that
        if ffi.buffer(box.magic)[:] != MAGIC or box.writers != WRITERS:
            raise OSError(0, "not an inbox of this version")
        at = int(ffi.cast("uintptr_t", box))
        cp.cuda.runtime.hostRegister(at, inbox_size(), HOST_MAPPED)
        own.callback(cp.cuda.runtime.hostUnregister, at)
        from common._transfer import lib as native
        slot = native.tx_inbox_claim(box, routes.engine.id + 1)
        if slot < 0:
            raise OSError(0, f"all {WRITERS} writer rings of that inbox are taken")
        self.slot, self.records = box.slot[slot], native.tx_inbox_records(box, slot)
        self.head = self.slot.consumed
        self.ffi = ffi
        self.mapped = {}  # IPC handle: its allocation's address here
        own.callback(self._close)
        routes.start(own)

    def _close(self):
        rt = self.routes.cp.cuda.runtime
        self.routes.stream.synchronize()  # no kernel still reads or writes what we unmap
        for base in self.mapped.values():
            rt.ipcCloseMemHandle(base)
        if self.slot.consumed == self.head:  # all counted: the ring is free for another
            self.slot.owner = 0

    def address_of(self, remote):
        """Where the peer's region is, for our GPU."""
        handle, offset, pid = remote.ipc
        if pid == os.getpid():
            return remote.ptr  # our own process: already mapped
        base = self.mapped.get(handle)
        if base is None:
            base = self.mapped[handle] = self.routes.cp.cuda.runtime.ipcOpenMemHandle(
                handle, LAZY_PEER_ACCESS)
        return base + offset

    def room(self):
        return self.head - self.slot.consumed < RECORDS

    def submit(self, command, until, timeout):
        """One command (engine.Command) as one kernel; its record says the peer's worker
        what came. Returns (record, seq): done once record.seq reaches seq."""
        copier = self.routes.copier
        memory.current(self.routes.engine.gpu)
        record, seq = self.records + (self.head & (RECORDS - 1)), self.head + 1
        parts = [command.src_offsets, command.dst_offsets]
        if command.lengths is not None:
            parts.append(command.lengths)
        table = copier.stage(parts, lambda: record.seq >= seq,
                             lambda ready, why: until(ready, timeout, why))
        count = len(command.src_offsets)
        record.imm, record.count = command.imm or 0, count
        record.has_imm = command.imm is not None
        self.head = seq
        copier(command.src.ptr, self.address_of(command.dst), table, count, command.length,
               command.lengths, int(self.ffi.cast("uintptr_t", record)), seq)
        return record, seq

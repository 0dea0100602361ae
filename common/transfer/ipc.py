"""The transfer engine's route inside a host: GPU to GPU by CUDA IPC, no NIC.

A NIC is the wrong path between two processes of one host whose pages are both in GPU
memory: libfabric's shm copies each WRITE on its own (a CUDA IPC copy per operation),
while one kernel copies thousands of pages at the GPU's memory speed (over NVLink between
two GPUs, or within one). So an engine made for a GPU exports its regions by CUDA IPC (a
handle in Region.descriptor()) and keeps an inbox, host memory shared with the peers of
its host (a memfd they open as /proc/<pid>/fd/<n>: nothing in /dev/shm to leave behind).
A writer whose peer is on this host (same boot, same pid namespace) and whose GPU can
reach the peer's sends each command to it as one kernel (ipc.cu, launched from C by
copier.c): the command's page numbers checked and handed to the GPU (a short table read
where it lies in pinned host memory, a long one uploaded), the pages copied into the
peer's memory, then, after a system-wide fence, the command's sequence number stored into
the writer's ring in the peer's inbox. A prepared command (Engine.prepare_pages) keeps its
table on the GPU: each of its writes is the launch alone.
The peer's C worker polls its inbox and counts the command's immediates in the same table
as a NIC's (worker.c, tx_inbox_poll): expect() does not know which route they took.

The contract is the libfabric route's: write_pages, write_list, scatter and the rest,
completion by immediate counts, in any order. A peer that dies is seen as on libfabric:
its inbox stops taking commands (the ring of RECORDS fills: the engine's timeout) or its
pages stop coming (expect's timeout); the memory a dead exporter shared stays mapped, so
the survivor's CUDA context stays usable (tried on an H200: a kernel writing into a
SIGKILLed peer's region, then a new allocation, both without error).
"""
import mmap
import os
import time
import uuid

import numpy as np

from common.fabric import memory
from common.gpu import INCLUDE, cuda_driver
from common.transfer import wire

WRITERS, RECORDS = 32, 1024    # writer rings in an inbox; commands in flight per writer
MAGIC = b"TXIPC01\0"
THREADS, CHUNK = 256, 8192     # a block's threads, bytes a block copies before it moves on
BLOCKS_PER_SM = 16
STAGING = 1 << 22              # bytes of each of the two rings that carry tables to the GPU
DIRECT = 512                   # tables this short (entries) the kernel reads in host memory
# The resident kernel (Engine(resident=True), ipc.cu's ipc_stand): its queue's slots and
# words a job, its states (on the GPU, deciding to leave, gone), the chunks a block of it
# may take per command
STAND_SLOTS, STAND_JOB, STAND_CHUNKS = 64, 10, 4
STAND_RUNNING, STAND_LEAVING, STAND_STOPPED = 1, 2, 3
IDLE = 1e-3                    # seconds it stays on the GPU without a command
HOST_MAPPED = 2                # cudaHostRegisterMapped
LAZY_PEER_ACCESS = 1           # cudaIpcMemLazyEnablePeerAccess
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
        self.address = wire.pack_host(*host, os.getpid(), self.fd, bus)


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
    return wire.pack_handle(bytes(handle), ptr - base, os.getpid())


class Routes:
    """An engine's side as a writer: a Copier (the kernel, the stream its commands run on
    in order: one block counter serves them all) and a Route per peer of this host."""

    def __init__(self, engine):
        self.engine, self.host = engine, this_host()

    def route(self, own, peer_host):
        """A Route to the peer whose address carried `peer_host` (wire.HOST), or (None,
        why)."""
        boot, namespace, pid, fd, bus = wire.parse_host(peer_host)
        if self.host != (boot, namespace):
            return None, "another host"
        gpu, rt = self.engine.gpu, memory.cupy().cuda.runtime
        try:
            theirs = rt.deviceGetByPCIBusId(bus)
        except Exception:
            return None, f"their GPU ({bus}) is not visible here"
        if theirs != gpu and not rt.deviceCanAccessPeer(gpu, theirs):
            return None, f"GPU {gpu} cannot access GPU {theirs} (no peer access)"
        try:
            route = Route(own, self.start(own), pid, fd, self.engine.id + 1,
                          self.engine.timeout)
        except OSError as e:
            return None, f"their inbox cannot be opened ({e.strerror})"
        return route, f"CUDA IPC, GPU {gpu} -> GPU {theirs}"

    def start(self, own):
        """The Copier, made once a first peer is on this host."""
        if not hasattr(self, "copier"):
            self.copier = Copier(self.engine.gpu, resident=self.engine.resident)
            own.callback(self.copier.quiet, self.engine.timeout)  # before its regions go
        return self.copier


class Copier:
    """ipc.cu's kernel on a stream of its own, on GPU `gpu` (the ceiling a benchmark
    compares the route with launches the same one: common/baselines.gather_ceiling),
    launched by copier.c, which writes each command's table into a ring of pinned host
    memory and uploads it, on a second stream, to a ring on the GPU, both allocated once.
    A table of at most `direct` entries the kernel reads from the pinned ring itself.
    With `resident`, small prepared commands go to a kernel that stays (_stand)."""

    def __init__(self, gpu, direct=None, resident=False):
        from common.transfer._native import ffi, lib as native
        cp = memory.cupy()
        memory.current(gpu)
        self.ffi, self.native, self.gpu = ffi, native, gpu
        self.stream = cp.cuda.Stream(non_blocking=True)
        module = cp.RawModule(code=open(KERNELS).read(), options=(INCLUDE,))
        self.kernel = module.get_function("ipc_copy")
        self.blocks_done = cp.zeros(1, cp.uint32)  # one: the stream runs a kernel at a time
        self._memory = [cp.cuda.alloc(STAGING), cp.cuda.alloc_pinned_memory(STAGING),
                        cp.cuda.alloc_pinned_memory(8)]  # the rings, the last kernel done
        device, host, finished = self._memory
        np.frombuffer(finished, np.uint64)[0] = 0
        driver = cuda_driver.function
        c = self.c = ffi.new("struct tx_copier *")
        c.launch, c.upload, c.record, c.wait = (
            ffi.cast("void *", cuda_driver.address(driver(name))) for name in (
                "cuLaunchKernel", "cuMemcpyHtoDAsync_v2", "cuEventRecord", "cuStreamWaitEvent"))
        self.uploads = cp.cuda.Stream(non_blocking=True)
        self.uploaded = cp.cuda.Event(disable_timing=True)
        c.kernel = ffi.cast("void *", self.kernel.kernel.ptr)
        context = cuda_driver.ffi.new("void **")
        cuda_driver.function("cuCtxGetCurrent")(context)  # GPU `gpu`'s: memory.current
        c.context = ffi.cast("void *", int(cuda_driver.ffi.cast("uintptr_t", context[0])))
        c.get_context, c.set_context = (
            ffi.cast("void *", cuda_driver.address(driver(name)))
            for name in ("cuCtxGetCurrent", "cuCtxSetCurrent"))
        c.stream, c.uploads, c.uploaded = (ffi.cast("void *", x.ptr) for x in (
            self.stream, self.uploads, self.uploaded))
        c.host, c.device = ffi.cast("uint64_t *", host.ptr), device.ptr
        c.entries, c.direct = STAGING // 8, DIRECT if direct is None else direct
        c.blocks_done, c.chunk, c.threads = self.blocks_done.data.ptr, CHUNK, THREADS
        sms = cp.cuda.runtime.getDeviceProperties(gpu)["multiProcessorCount"]
        c.max_blocks = BLOCKS_PER_SM * sms
        c.finished = ffi.cast("uint64_t *", finished.ptr)
        if resident:
            self._stand(module.get_function("ipc_stand"), sms)

    def _stand(self, kernel, sms):
        """The resident kernel's queue, scratch and stream: copier.c launches it on the
        first small prepared command, and again on the first after it left. Its stream
        does not wait for the legacy default one, nor that one for it: a kernel that stays
        would hold up every command on a stream that did."""
        cp, ffi, c = memory.cupy(), self.ffi, self.c
        words = 4 + STAND_SLOTS * STAND_JOB
        queue = cp.cuda.alloc_pinned_memory(8 * words)
        scratch = cp.zeros(2 + STAND_SLOTS + STAND_SLOTS * STAND_JOB, cp.uint64)
        self._memory += [queue, scratch, kernel]
        self.queue = np.frombuffer(queue, np.uint64, words)
        self.queue[:] = 0
        self.queue[1] = STAND_STOPPED
        self.stand_stream = cp.cuda.Stream(non_blocking=True)
        c.stand, c.stand_stream = (ffi.cast("void *", x) for x in (
            kernel.kernel.ptr, self.stand_stream.ptr))
        c.queue, c.scratch = ffi.cast("uint64_t *", queue.ptr), scratch.data.ptr
        c.idle_ns, c.stand_blocks = int(IDLE * 1e9), sms + 1  # a worker an SM, a leader
        c.stand_items = STAND_CHUNKS * sms

    def rest(self, timeout):
        """The resident kernel off the GPU (if it is on): told to leave now, waited for
        at most `timeout` s, its stream too (a leader that left may leave workers finishing
        their last jobs). The next small prepared command launches it again."""
        if getattr(self, "queue", None) is None:
            return
        self.queue[3] = 1  # quit: the leader hands out what is queued, then leaves
        deadline = time.monotonic() + timeout
        while self.queue[1] != STAND_STOPPED:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the resident copier kernel did not leave GPU "
                                   f"{self.gpu} within {timeout:g} s")
            os.sched_yield()
        self.stand_stream.synchronize()  # its workers done with the last jobs
        self.queue[3] = 0

    def quiet(self, timeout):
        """Nothing of ours left running on the GPU: the resident kernel gone (within
        `timeout` s), the stream done."""
        self.rest(timeout)
        self.stream.synchronize()

    def send(self, src, src_items, dst, dst_items, length, wait, sizes, page_size=None,
             lengths=None, seq_at=0, seq=0):
        """Queue the copies of one command on the stream: WRITE i from page (or byte
        offset, page_size None) src_items[i] of the memory at device address `src` to
        dst_items[i] of `dst`, `length` bytes or lengths[i] (pages_of's arrays), then
        store `seq` at host address `seq_at` (none where 0). `sizes`: the two regions'
        sizes (an int: both). `wait(ready, why)` waits for room in the rings (the engine's
        _until). Returns None, or (side, index) of the first item out of range (side 0:
        source, 1: destination): then nothing was queued."""
        ffi = self.ffi
        a = ffi.new("struct tx_copy *")
        a.src_items, a.dst_items = ffi.from_buffer(src_items), ffi.from_buffer(dst_items)
        a.src_signed, a.dst_signed = src_items.dtype.kind == "i", dst_items.dtype.kind == "i"
        a.count, a.scale, a.length = len(src_items), page_size or 1, length
        if lengths is not None:
            a.lengths = ffi.from_buffer("uint64_t[]", lengths)
        a.src_size, a.dst_size = (sizes, sizes) if isinstance(sizes, int) else sizes
        a.src, a.dst, a.seq_at, a.seq = src, dst, ffi.cast("uint64_t *", seq_at), seq
        while True:
            rc = self.native.tx_copy(self.c, a)
            if rc == 0:
                return None
            if rc == 1:
                return a.bad_side, a.bad
            if rc != 2:
                raise ValueError("the CUDA IPC route's launch failed: "
                                 f"{cuda_driver.error_name(self.c.rc)}")
            need = (2 if lengths is None else 3) * self.native.tx_copy_piece(self.c, a)
            wait(lambda: self.native.tx_copier_room(self.c, need),
                 lambda: f"room for a table of {need} entries in the staging ring")


class Route:
    """The writer's CUDA IPC route to one peer of this host: its inbox (the memfd `fd` of
    process `pid`) mapped here (and for the GPU, whose kernel stores each command's seq
    into it), a ring of it ours, claimed as `writer` (nonzero); `copier` sends the
    commands; closing waits up to `timeout` s for its kernels."""

    def __init__(self, own, copier, pid, fd, writer, timeout):
        ffi, cp = copier.ffi, memory.cupy()
        self.copier, self.timeout = copier, timeout
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
        native = copier.native
        slot = native.tx_inbox_claim(box, writer)
        if slot < 0:
            raise OSError(0, f"all {WRITERS} writer rings of that inbox are taken")
        self.slot, self.records = box.slot[slot], native.tx_inbox_records(box, slot)
        self.head = self.slot.consumed
        self.ffi = ffi
        self.mapped = {}  # IPC handle: its allocation's address here
        own.callback(self._close)

    def _close(self):
        rt = memory.cupy().cuda.runtime
        self.copier.quiet(self.timeout)  # no kernel still reads or writes what we unmap
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
            memory.current(self.copier.gpu)  # mapped into that GPU's context
            base = self.mapped[handle] = memory.cupy().cuda.runtime.ipcOpenMemHandle(
                handle, LAZY_PEER_ACCESS)
        return base + offset

    def room(self):
        return self.head - self.slot.consumed < RECORDS

    def _record(self, imm, count):
        """The next command's record in our ring of the peer's inbox, filled but for its
        seq (the kernel stores that last), and that seq."""
        record = self.copier.native.tx_inbox_next(
            self.records, RECORDS - 1, self.head, imm or 0, imm is not None, count)
        return record, self.head + 1

    def launch(self, a, imm, src, dst):
        """A prepared command (commands.Prepared's struct tx_copy, its table on the GPU)
        from device address `src` to `dst`, as one kernel, or a job for the resident one;
        its record says the peer's worker what came (copier.c fills it). Returns (record,
        seq)."""
        copier = self.copier  # copier.c makes its GPU's context current
        if copier.native.tx_write_prepared(copier.c, a, self.records, RECORDS - 1, self.head,
                                           imm or 0, imm is not None, src, dst):
            raise ValueError("the CUDA IPC route's launch failed: "
                             f"{cuda_driver.error_name(copier.c.rc)}")
        self.head += 1
        return self.records + ((self.head - 1) & (RECORDS - 1)), self.head

    def submit(self, command, wait):
        """One command (commands.Command) as the copier's kernels; its record says the peer's
        worker what came. Returns (record, seq, None): done once record.seq reaches seq;
        or (None, None, (side, index)) for an item out of range, nothing sent."""
        record, seq = self._record(command.imm, len(command.src_items))
        bad = self.copier.send(
            command.src.ptr, command.src_items, self.address_of(command.dst),
            command.dst_items, command.length, wait, (command.src.size, command.dst.size),
            command.page_size, command.lengths, int(self.ffi.cast("uintptr_t", record)), seq)
        if bad:
            return None, None, bad
        self.head = seq
        return record, seq, None

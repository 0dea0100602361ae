"""The transfer engine itself: Engine, its peers, regions and commands (see the package's
docstring); the byte formats are wire.py's, the control endpoint control.py's."""
import collections
import os
import secrets
import struct
import threading
import time
import zlib

import numpy as np

import common.fabric as fi
from common import bounds, launch
from common.engine import topo
from common.engine.nics import rank_nics
from common.fabric import cuda_driver, lib, memory
from common.transfer import ipc, wire
from common.transfer.control import Control

try:
    from common._transfer import ffi as _ffi, lib as native
except ImportError as e:  # not built, or built before worker.c existed
    raise ImportError(f"the transfer engine's worker is not built ({e}): run "
                      "'.venv/bin/python common/_build_native.py'") from None

RING = 1024            # commands queued at once (a power of two)
IMM_TABLE = 1 << 14    # distinct immediate values the arrival table holds (a power of two)
SIGNAL = 8             # bytes of the signal region a barrier writes into
NAP_US = 20            # the worker's sleep when idle a while (it yields before that)
# A wait (Engine._until) spins for its first HOT seconds, yields until SPIN, then naps
# (a yield took about 1 us on an H200 box, a resident copier's command 7 us there:
# results/transfer/README.md); it looks at the worker, the watchers and the control CQ
# at least every CHECK_EVERY seconds (each look took 3-5 us there)
HOT, SPIN, CHECK_EVERY = 20e-6, 1e-3, 50e-6
SPREADS = ("round-robin", "per-peer")
PHASES = ("building", "picking up", "posting", "completing", "seeing")  # Transfer.phases
CACHE_SIZE = "FI_MR_CACHE_MAX_SIZE"  # see Engine: GPU regions larger than its default


# A command, every argument checked but its items (pages_of's arrays): WRITE i goes from
# page src_items[i] of src to page dst_items[i] of dst, or from byte offset to byte offset
# where page_size is None; length bytes each, or lengths[i]
Command = collections.namedtuple(
    "Command", "peer src dst src_items dst_items page_size length lengths imm inject")


class TransferError(fi.FabricError):
    """A WRITE failed; the text is the provider's (fi_cq_strerror) or the call's. A
    FabricError, so that a chapter says it in one line (cli.run): tcp fails the WRITEs in
    flight to a peer that died."""

    def __init__(self, text, rc=0):
        RuntimeError.__init__(self, text)  # the whole text: no call of ours to name first
        self.call, self.rc, self.text = "a WRITE", rc, text


class Peer:
    """Another engine, connected: its address in each of our NICs' AVs."""

    def __init__(self, index, ident, addrs, signal, control):
        self.index, self.id = index, ident
        self.addr = addrs        # fi_addr_t[nics]: its NIC i in our NIC i's AV
        self.signal = signal     # its signal region (a RemoteRegion)
        self.control = control   # its control endpoint in our control AV
        self.ipc = None          # an ipc.Route where GPU pages go by CUDA IPC
        self.route = "libfabric"  # or "cuda-ipc": how pages between GPU memory go ...
        self.why = "host memory"  # ... and why

    def __repr__(self):
        return f"Peer({self.index})"


class Region:
    """Memory registered on every NIC's domain, as a WRITE's source and target."""

    def __init__(self, engine, ptr, size, descs, bases, keys, gpu=None, ipc_handle=b""):
        self.engine, self.ptr, self.size, self.gpu = engine, ptr, size, gpu
        self.descs = _ffi.new("void *[]", descs)
        self.bases, self.keys = bases, keys
        self.ipc_handle = ipc_handle  # ipc.HANDLE, for GPU memory CUDA can share

    def descriptor(self):
        """Everything a peer needs to WRITE into this region: address, size, per NIC
        (remote base, key), and for GPU memory its CUDA IPC handle. Send it (a control
        message, an allgather)."""
        return wire.pack_region(self.ptr, self.size, self.bases, self.keys, self.ipc_handle)


class RemoteRegion:
    """A peer's region, from its descriptor."""

    def __init__(self, ptr, size, bases, keys, ipc_handle=None):
        self.ptr, self.size = ptr, size
        self.bases = _ffi.new("uint64_t[]", bases)
        self.keys = _ffi.new("uint64_t[]", keys)
        self.ipc = ipc_handle  # (handle, offset, pid) where CUDA IPC can map it


class Transfer:
    """One command's WRITEs: done when every one completed; wait() raises on failure."""

    def __init__(self, engine, command, keep):
        self.engine, self.command, self._keep = engine, command, keep
        self.count = command.count

    @property
    def done(self):
        return native.tx_done(self.command) >= self.count

    def wait(self, timeout=None):
        """Wait until every WRITE completed; TransferError (the provider's text) if one
        failed, TimeoutError after `timeout` s (default: the engine's)."""
        timeout = self.engine.timeout if timeout is None else timeout
        self.engine._until(lambda: self.done, timeout, lambda: (
            f"{self.count} WRITEs not completed within {timeout:g} s "
            f"({native.tx_done(self.command)} completed, {self.command.posted} posted)"))
        self.raise_failure()
        return self

    def phases(self, called, returned):
        """Where a finished command's time went, in seconds: from the call that made it
        (`called`, time.monotonic_ns()) to its queuing (Python building it), the worker's
        first post, its last post, the last completion, and `returned` (time.monotonic_ns()
        once wait() returned: Python seeing it). The worker's stamps are CLOCK_MONOTONIC's,
        time.monotonic's clock."""
        marks = [called, *(int(t) for t in self.command.ns), returned]
        return {name: (b - a) * 1e-9 for name, a, b in zip(PHASES, marks, marks[1:])}

    def raise_failure(self):
        c = self.command
        if native.tx_status(c):
            raise TransferError(f"WRITE on NIC {c.failed_nic} failed: "
                                f"{_ffi.string(c.error).decode(errors='replace')} "
                                f"(ret {c.status}; {c.skipped} of {c.count} not posted)",
                                c.status)


class IpcTransfer:
    """One command sent by CUDA IPC (ipc.py): done once its kernel stored its sequence
    number into the peer's inbox; nothing can fail after the launch but the GPU itself."""

    def __init__(self, engine, record, seq, count, queued, launched):
        self.engine, self.record, self.seq = engine, record, seq
        self.count, self.ns = count, (queued, launched, 0)  # ns: queued, launched, seen

    @property
    def done(self):
        if self.ns[2]:
            return True
        if self.record.seq < self.seq:  # a later lap of the ring stores a larger one
            return False
        self.ns = (*self.ns[:2], time.monotonic_ns())
        return True

    def wait(self, timeout=None):
        timeout = self.engine.timeout if timeout is None else timeout
        self.engine._until(lambda: self.done, timeout, lambda: (
            f"a command of {self.count} copies by CUDA IPC not done within {timeout:g} s"))
        return self

    def phases(self, called, returned):
        """As Transfer.phases: building (Python), posting (the launch), completing (the
        kernel, until Python saw its mark), seeing; no worker picks it up."""
        queued, launched, seen = self.ns
        marks = [called, queued, queued, launched, seen or returned, returned]
        return {name: (b - a) * 1e-9 for name, a, b in zip(PHASES, marks, marks[1:])}

    def raise_failure(self):
        pass


class Prepared:
    """A command made once and written many times (Engine.prepare_pages, prepare_list), as
    a KV cache's layers or a model's weights are sent again and again with the same layout.
    Its items are checked and turned into byte offsets once; on the CUDA IPC route its
    table goes to the GPU once, so that each write() is one kernel launch, with no pass
    over the items and no upload. On libfabric each write() hands the worker those
    offsets, shifted.

    write(imm, src_shift, dst_shift): the same WRITEs, every source item moved by
    src_shift and every destination item by dst_shift (pages, or bytes for prepare_list):
    chapter 18's layer l is layer 0's pages, shifted."""

    def __init__(self, engine, command):
        self.engine, self.command = engine, command
        self.unit = command.page_size or 1
        offsets = self.offsets = [offsets_of(command, side) for side in (0, 1)]  # checked
        ends = [o + (command.length if command.lengths is None else command.lengths)
                for o in offsets]
        self.reach = [int(e.max()) if len(e) else 0 for e in ends]  # the furthest byte
        self.route = engine._route(command)
        if self.route:
            self._on_gpu(offsets)

    def _on_gpu(self, offsets):
        """The kernel's table (byte offsets, then lengths), uploaded on the copier's stream
        for uploads, which its kernels' stream then waits for: an upload from pageable
        memory waits for its stream's earlier work, which on the kernels' stream would be
        the copies in flight. An IpcTransfer keeps the table until its kernel is done."""
        c, cp = self.command, memory.cupy()
        parts = offsets if c.lengths is None else [*offsets, c.lengths]
        memory.current(self.engine.gpu)
        copier = self.route.routes.copier
        with copier.uploads:
            self.table = cp.asarray(np.concatenate(parts).astype(np.uint64))
            uploaded = cp.cuda.Event(disable_timing=True)
            uploaded.record()
        copier.stream.wait_event(uploaded)
        a = self.args = _ffi.new("struct tx_copy *")
        a.count, a.scale, a.length = len(offsets[0]), 1, c.length
        a.table, a.table_lengths = self.table.data.ptr, c.lengths is not None
        a.longest = c.length if c.lengths is None else int(c.lengths.max(initial=0))
        self.src, self.dst = c.src.ptr, self.route.address_of(c.dst)

    def write(self, imm=None, src_shift=0, dst_shift=0):
        eng, c = self.engine, self.command
        eng._check_imm(imm)
        if src_shift or dst_shift:  # the unshifted command was checked when it was made
            self._check_shifts(src_shift, dst_shift)
        if not self.route:  # the offsets checked when it was made, shifted
            eng._check()
            return eng._post(c._replace(imm=imm), self.offsets[0] + src_shift * self.unit,
                             self.offsets[1] + dst_shift * self.unit)
        # The CUDA IPC route, lean: a launch is ~6 us here and the kernel of 100 pages 6-8
        eng._check()
        route = self.route
        if not route.room():
            eng._room(route, c.peer)
        queued = time.monotonic_ns()
        record, seq = route.launch(self.args, imm, self.src + src_shift * self.unit,
                                   self.dst + dst_shift * self.unit)
        eng._ipc_commands += 1
        t = IpcTransfer(eng, record, seq, self.args.count, queued, time.monotonic_ns())
        t.keep = self.table  # read by the kernel until it is done
        return eng._track(t)

    def _check_shifts(self, src_shift, dst_shift):
        c = self.command
        for name, shift, region, reach in (("src_shift", src_shift, c.src, self.reach[0]),
                                           ("dst_shift", dst_shift, c.dst, self.reach[1])):
            if not isinstance(shift, (int, np.integer)) or shift < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {shift!r}")
            if reach + shift * self.unit > region.size:
                raise ValueError(f"{name} {shift} puts bytes up to {reach + shift * self.unit}"
                                 f" in a region of {region.size}")


class Group:
    """Engines that scatter and meet at barriers: `peers`, member i being peers[i]."""

    def __init__(self, engine, peers):
        self.engine, self.members = engine, list(peers)

    def scatter(self, src, dsts, length, imm=None):
        """Slice i of `src` (bytes [i*length, (i+1)*length)) to member i's region dsts[i]
        (at its start), each WRITE with `imm`. One Transfer for all of them."""
        if len(dsts) != len(self.members):
            raise ValueError(f"{len(dsts)} destinations for {len(self.members)} members")
        parts = [self.engine._command(p, src, np.array([i * length], np.uint64), d,
                                      np.zeros(1, np.uint64), length, imm)
                 for i, (p, d) in enumerate(zip(self.members, dsts))]
        for part in parts:  # all checked before the first is posted
            offsets_of(part, 0), offsets_of(part, 1)
        return _Several([self.engine._submit(part) for part in parts])

    def barrier(self, imm, timeout=None):
        """An 8-byte WRITE with `imm` to each member's signal region, then wait for one
        from each member (expect(imm, len(members)))."""
        timeout = self.engine.timeout if timeout is None else timeout
        eng = self.engine
        sent = [eng.signal(p, imm) for p in self.members]
        eng.expect(imm, len(self.members), timeout)
        for t in sent:
            t.wait(timeout)


class _Several:
    """Transfers that are done together (a scatter's, one per member)."""

    def __init__(self, transfers):
        self.transfers = transfers
        self.count = sum(t.count for t in transfers)

    @property
    def done(self):
        return all(t.done for t in self.transfers)

    def wait(self, timeout=None):
        for t in self.transfers:
            t.wait(timeout)
        return self


class Engine:
    """One GPU's (or process's) transfer engine; see the package's docstring."""

    def __init__(self, own, provider=None, gpu=None, nics=None, spread="round-robin",
                 timeout=30.0, cuda_ipc=True, resident=False, peers=1):
        if spread not in SPREADS:
            raise ValueError(f"spread must be one of {', '.join(SPREADS)}, not {spread!r}")
        if nics is not None and nics < 1:
            raise ValueError(f"nics must be at least 1, not {nics}")
        if not isinstance(peers, int) or peers < 1:
            raise ValueError(f"peers must be a positive integer, not {peers!r}")
        self.timeout, self.gpu, self.spread = timeout, gpu, spread
        # Small prepared commands on the CUDA IPC route go to a kernel that stays on the
        # GPU while they come (ipc.IDLE): no launch each. It keeps a block on every SM
        # meanwhile, and a device-wide synchronize waits until it leaves (Engine.rest).
        self.resident = resident
        memory.use_gpu(gpu)  # no cupy, no such GPU: one line, before anything is opened
        if gpu is not None and CACHE_SIZE not in os.environ:
            # shm maps a peer's GPU region by CUDA IPC and keeps the mapping in the MR
            # cache, by default RAM / cores / 2 bytes (prov/util/src/util_mem_monitor.c,
            # ofi_default_cache_size); once that is full, a region is mapped again for
            # every WRITE: on one H200 box, 8 GB regions then stalled for 30 s and more.
            # Read when libfabric starts, so only before a process's first fi_getinfo.
            os.environ[CACHE_SIZE] = str(1 << 40)
        info, _ = fi.pick(provider, lib.FI_MSG | lib.FI_RMA, hmem=gpu is not None)
        self.provider = fi.provider_of(info)
        # A NIC (efa, verbs) writes GPU memory by GPUDirect RDMA: seeing its completion on
        # the host does not make those writes visible to the GPU's later reads unless the
        # device orders them for their owner; else expect() flushes them (CUDA driver API,
        # cuFlushGPUDirectRDMAWrites). shm and tcp copy with the CPU or CUDA calls
        # themselves: None, nothing to flush. A device that can do neither: refused here.
        self.flush_scope = cuda_driver.flush_scope(self.provider, gpu)
        # the GPU's NICs, or this process's share of the node's: its place from the launcher
        self.infos, self.nics = rank_nics(info, launch.place_from_environment(), gpu, nics)
        self.cq_data_size = min(i.domain_attr.cq_data_size for i in self.infos)
        # the cut of a longer WRITE (chapter 19): on efa one WRITE, one immediate
        self.max_write = min(fi.max_write(i) for i in self.infos)
        self.inject_size = inject_size(self.infos)
        # control messages go through NIC 0 (Control), so its link carries them
        self.max_send = fi.max_send(self.infos[0])
        self.id = secrets.randbits(32)
        self._keys = iter(range(1, 1 << 30))  # requested MR keys (tcp takes ours: unique)
        self._watch, self._peers, self._taken = [], {}, {}
        self._inflight, self._prune_at = [], 16  # Transfers the worker may still touch
        # tx_free runs last: after the endpoints closed, no WRITE owns a context any more
        w = self._w = _ffi.new("struct tx_worker *")
        own.callback(native.tx_free, w)
        slots = fi.in_flight(info)
        # Each NIC's CQ holds our WRITEs in flight and those of `peers` engines writing
        # into us at once, each as many as its worker has in flight (the same `slots`): a
        # WRITE with an immediate lands an entry here (fabric.cq_size_for), and an EFA
        # device CQ has exactly the entries asked for. It bounds what is in flight, not
        # what a worker kept from reading its CQ lets pile up.
        opened = [fi.open_endpoint(own, i, cq_size=fi.cq_size_for(i, slots, peers * slots),
                                   av_count=256, shm=False) for i in self.infos]
        self.domains, self.cqs, self.avs, self.eps = (list(x) for x in zip(*opened))
        self._control = Control(own, self.domains[0], self.infos[0], self.max_send,
                                self._keys, self._until)
        n = len(self.infos)
        self._arrays = [_ffi.new("struct fid_ep *[]", self.eps),
                        _ffi.new("struct fid_cq *[]", self.cqs),
                        _ffi.new("struct tx_command *[]", RING),
                        _ffi.new("uint64_t[]", IMM_TABLE), _ffi.new("uint64_t[]", IMM_TABLE),
                        _ffi.new("uint8_t[]", IMM_TABLE)]
        (w.eps, w.cqs, w.ring, w.imm_keys, w.imm_counts, w.imm_used) = self._arrays
        w.nics, w.slots, w.ring_size, w.imm_size, w.nap_us = n, slots, RING, IMM_TABLE, NAP_US
        # GPU pages to a peer of this host by CUDA IPC (ipc.py), unless cuda_ipc=False
        self._own, self._inbox, self._routes, self._ipc_commands = own, None, None, 0
        self.ipc_why = "host memory" if gpu is None else "cuda_ipc=False"
        if gpu is not None and cuda_ipc:
            try:
                self._inbox = ipc.Inbox(own, _ffi, ipc.bus_id(gpu))
                self._routes = ipc.Routes(self, _ffi)
                w.inbox = self._inbox.box
            except OSError as e:
                self.ipc_why = f"no inbox for CUDA IPC ({e.strerror or e})"
        self._regions = fi.Closer()  # the regions' registrations: closed once the worker stops
        self._held = []  # ... and their arrays: a peer may WRITE into them until then
        # A callback of its own, not a step of _stop: a Ctrl-C that cuts into the worker's
        # join must not skip them, or the domain is closed under them (fi_close: -EBUSY)
        own.callback(self._held.clear)
        own.callback(self._regions.close)
        self._signal = self.register(np.zeros(SIGNAL, np.uint8))
        self.rc, self.error = None, None
        self._thread = threading.Thread(target=self._run, args=(worker_cores(gpu),),
                                        daemon=True, name="transfer worker")
        # runs first: before the registrations and endpoints close; set before the thread
        # starts, as a Ctrl-C in between would leave it reading CQs as they close
        own.callback(self._stop)
        self._thread.start()

    # --- setting up -------------------------------------------------------------------

    def _run(self, cores):
        try:
            if cores:  # chapter 12: this thread, near its GPU; best effort
                try:
                    os.sched_setaffinity(0, cores)
                except OSError:
                    pass
            if self.gpu is not None:  # libfabric's CUDA copies use this thread's GPU
                memory.use_gpu(self.gpu)
            self.rc = native.tx_run(self._w)  # the GIL is released for the call
        except Exception as e:  # raised by the next wait, in one line
            self.error, self.rc = e, -lib.FI_EOTHER

    def _stop(self):
        self._w.stop = 1
        bounds.join([self._thread], "the transfer engine")
        self.error = TransferError("this engine is closed (its Closer has run): nothing more "
                                   "can be sent or awaited")

    # --- addresses and regions ---------------------------------------------------------

    def address(self):
        """All a peer needs to connect: our id, control address, NIC count, each data
        NIC's address and our signal region's descriptor."""
        inbox = self._inbox.address if self._inbox else b""
        return wire.pack_address(self.id, fi.getname(self._control.ep), inbox,
                                 [fi.getname(ep) for ep in self.eps], self._signal.descriptor())

    def connect(self, address):
        """The Peer at `address` (another engine's address()): inserted in every AV. Its
        `route` says how GPU pages go to it: "cuda-ipc" where it is on this host and our
        GPU reaches its GPU (ipc.py), else "libfabric"; `why` says why."""
        ident, control, inbox, names, signal = wire.parse_address(address)
        if len(names) != len(self.eps):
            raise ValueError(f"that engine has {len(names)} NICs and this one "
                             f"{len(self.eps)}: NIC i writes to NIC i, so counts must match")
        if ident in self._peers:
            return self._peers[ident]
        # a peer's address is never trusted: checked before each AV takes it (fi.av_insert)
        addrs = _ffi.new("fi_addr_t[]", [fi.av_insert(av, n, info) for av, n, info
                                         in zip(self.avs, names, self.infos)])
        peer = Peer(len(self._peers), ident, addrs, self.remote(signal),
                    fi.av_insert(self._control.av, control, self.infos[0]))
        peer.nic = per_peer_nic(self.id, ident, len(self.eps))
        peer.why = self.ipc_why if not self._routes else "it has no GPU engine"
        if self._routes and inbox:
            peer.ipc, peer.why = self._routes.route(self._own, inbox)
            peer.route = "cuda-ipc" if peer.ipc else "libfabric"
        self._peers[ident] = peer
        return peer

    def register(self, array):
        """Register `array` (numpy, cupy or torch; contiguous; not copied) on every NIC's
        domain, for WRITEs from it and into it. The engine holds the array until it closes,
        as long as the registration lasts: a peer may WRITE into it until then."""
        ptr, size, gpu = buffer_of(array)
        if size == 0:
            raise ValueError("cannot register an empty array")
        if gpu is not None and self.gpu is None:
            raise ValueError(f"GPU {gpu} memory, but this engine was made for host memory "
                             "(Engine(..., gpu=N) registers GPU memory)")
        access = lib.FI_WRITE | memory.WRITE_TARGET
        descs, bases, keys = [], [], []
        for info, domain in zip(self.infos, self.domains):
            key = next(self._keys)
            if gpu is None:
                mr = self._regions(fi.mr_reg(domain, ptr, size, access, key))
            else:
                mr, how = memory.register_device(domain, ptr, size, access, key,
                                                 lib.FI_HMEM_CUDA, gpu)
                self._regions(mr)
            descs.append(fi.mr_desc(mr))
            bases.append(fi.remote_base(info, ptr))
            keys.append(fi.mr_key(mr))
        self._held.append(array)
        handle = ipc.export(ptr) if gpu is not None and self._inbox else None
        return Region(self, ptr, size, descs, bases, keys, gpu, handle or b"")

    def remote(self, descriptor):
        """A peer's region from its descriptor (Region.descriptor() over there)."""
        ptr, size, bases, keys, handle = wire.parse_region(descriptor)
        if len(keys) != len(self.eps):
            raise ValueError(f"that region is registered on {len(keys)} NICs, this engine has "
                             f"{len(self.eps)}: NIC counts must match")
        return RemoteRegion(ptr, size, bases, keys, handle)

    # --- WRITEs --------------------------------------------------------------------

    def write(self, peer, src, src_offset, dst, dst_offset, length, imm=None, inject=False):
        """One WRITE of `length` bytes from src[src_offset:] to dst[dst_offset:].

        inject=True (here and in write_pages, write_list): each WRITE of at most
        inject_size bytes is injected (fi_inject_write, fi_inject_writedata) and done once
        posted: the provider has copied its source, which may be reused at once, but
        nothing says it was delivered; the receiver's count of its immediate does. No
        command can say it failed: an error entry the provider writes for it (with no
        context) stops the engine, every later call raising. Longer WRITEs go as without
        inject, with a completion."""
        for name, value in (("src_offset", src_offset), ("dst_offset", dst_offset)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
        return self._submit(self._command(peer, src, np.array([src_offset], np.uint64), dst,
                                          np.array([dst_offset], np.uint64), length, imm,
                                          inject))

    def write_pages(self, peer, src, src_pages, dst, dst_pages, page_size, imm=None,
                    inject=False):
        """Page src_pages[i] of `src` to page dst_pages[i] of `dst` (page p: bytes
        [p*page_size, (p+1)*page_size)), one WRITE each, all posted by the worker."""
        return self._submit(self._pages(peer, src, src_pages, dst, dst_pages, page_size,
                                        imm, inject))

    def write_list(self, peer, src, src_offsets, dst, dst_offsets, lengths, imm=None,
                   inject=False):
        """WRITE i: lengths[i] bytes from src[src_offsets[i]:] to dst[dst_offsets[i]:],
        all posted by the worker (chapter 19: a layer's tensors of several sizes)."""
        return self._submit(self._list(peer, src, src_offsets, dst, dst_offsets, lengths,
                                       imm, inject))

    def prepare_pages(self, peer, src, src_pages, dst, dst_pages, page_size, inject=False):
        """write_pages made once, to be written many times (Prepared.write): its pages
        checked now, and on the CUDA IPC route its table put on the GPU now."""
        return Prepared(self, self._pages(peer, src, src_pages, dst, dst_pages, page_size,
                                          None, inject))

    def prepare_list(self, peer, src, src_offsets, dst, dst_offsets, lengths, inject=False):
        """write_list made once, to be written many times (Prepared.write)."""
        return Prepared(self, self._list(peer, src, src_offsets, dst, dst_offsets, lengths,
                                         None, inject))

    def _pages(self, peer, src, src_pages, dst, dst_pages, page_size, imm, inject):
        if not isinstance(page_size, (int, np.integer)) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, not {page_size!r}")
        src_pages, dst_pages = pages_of(src_pages, "src_pages"), pages_of(dst_pages, "dst_pages")
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} "
                             "destination pages")
        return self._command(peer, src, src_pages, dst, dst_pages, page_size, imm, inject,
                             page_size=int(page_size))

    def _list(self, peer, src, src_offsets, dst, dst_offsets, lengths, imm, inject):
        offsets = [pages_of(x, name, "byte counts") for x, name in (
            (src_offsets, "src_offsets"), (dst_offsets, "dst_offsets"), (lengths, "lengths"))]
        if len({len(x) for x in offsets}) != 1:
            raise ValueError(f"{len(offsets[0])} source offsets, {len(offsets[1])} "
                             f"destination offsets and {len(offsets[2])} lengths")
        if len(offsets[2]) and offsets[2].dtype.kind == "i" and offsets[2].min() < 0:
            raise ValueError(f"lengths has a negative byte count ({int(offsets[2].min())})")
        return self._command(peer, src, offsets[0], dst, offsets[1],
                             offsets[2].astype(np.uint64), imm, inject)

    def _check_ends(self, peer, src, dst):
        if not isinstance(peer, Peer) or self._peers.get(peer.id) is not peer:
            raise ValueError("that peer is not one of this engine's (use Engine.connect)")
        if not isinstance(src, Region) or src.engine is not self:
            raise ValueError("the source must be a region registered by this engine "
                             "(Engine.register)")
        if not isinstance(dst, RemoteRegion):
            raise ValueError("the destination must be a RemoteRegion (Engine.remote)")

    def _command(self, peer, src, src_items, dst, dst_items, length, imm, inject=False,
                 page_size=None):
        """A Command, every argument checked but the items (_submit's route checks them as
        it builds the WRITEs' offsets): ValueError, nothing posted. The items are page
        numbers of `page_size` bytes, or byte offsets (page_size None), int64 or uint64
        (pages_of); `length`: every WRITE's, or an array of one per WRITE."""
        self._check_ends(peer, src, dst)
        lengths = length if isinstance(length, np.ndarray) else None
        if lengths is None and not isinstance(length, (int, np.integer)):
            raise ValueError(f"a WRITE's length must be an integer, not {length!r}")
        sizes = [length] if lengths is None else \
            [int(lengths.min()), int(lengths.max())] if len(lengths) else []
        for size in sizes:
            if not 0 < size <= self.max_write:
                raise ValueError(f"a WRITE's length must be 1 to {self.max_write} bytes "
                                 f"({self.provider}'s largest), not {size}")
        self._check_imm(imm)
        return Command(peer, src, dst, src_items, dst_items, page_size,
                       0 if lengths is not None else int(length), lengths, imm, inject)

    def _check_imm(self, imm):
        bits = 8 * self.cq_data_size
        if imm is not None and (not isinstance(imm, (int, np.integer))
                                or not 0 <= imm < 1 << bits):
            raise ValueError(f"imm {imm!r} does not fit the {self.cq_data_size} bytes of "
                             f"immediate data {self.provider} carries (0 to {(1 << bits) - 1})")

    def _route(self, command):
        """The ipc.Route that carries `command`, or None: libfabric."""
        peer, src, dst = command.peer, command.src, command.dst
        return peer.ipc if peer.ipc and dst.ipc and src.gpu == self.gpu else None

    def _submit(self, command):
        self._check()
        route = self._route(command)
        if route:
            return self._submit_ipc(route, command)
        return self._post(command, offsets_of(command, 0), offsets_of(command, 1))

    def _post(self, command, src_offsets, dst_offsets):
        """Hand the worker `command`, its items as byte offsets already checked."""
        peer, src, dst = command.peer, command.src, command.dst
        w = self._w
        if w.head - native.tx_tail(w) >= RING:
            self._until(lambda: w.head - native.tx_tail(w) < RING, self.timeout,
                        lambda: f"room in the worker's ring of {RING} commands")
        c = _ffi.new("struct tx_command *")
        c.count, c.length = len(src_offsets), command.length
        if command.lengths is not None:
            c.lengths = _ffi.cast("uint64_t *", command.lengths.ctypes.data)
        c.src = _ffi.cast("uint64_t *", src_offsets.ctypes.data)
        c.dst = _ffi.cast("uint64_t *", dst_offsets.ctypes.data)
        c.local_base = _ffi.cast("char *", src.ptr)
        c.local_descs, c.remote_base, c.remote_key = src.descs, dst.bases, dst.keys
        c.addr = peer.addr
        c.round_robin = self.spread == "round-robin"
        c.nic = peer.nic
        c.has_imm, c.imm = command.imm is not None, command.imm or 0
        c.inject_size = self.inject_size if command.inject else 0
        t = self._track(Transfer(self, c, (command, src_offsets, dst_offsets)))
        native.tx_submit(w, c)
        return t

    def _submit_ipc(self, route, command):
        self._room(route, command.peer)
        queued = time.monotonic_ns()
        record, seq, bad = route.submit(
            command, lambda ready, why: self._until(ready, self.timeout, why))
        if bad:
            refuse(command, *bad)
        self._ipc_commands += 1
        return self._track(IpcTransfer(self, record, seq, len(command.src_items), queued,
                                       time.monotonic_ns()))

    def _room(self, route, peer):
        if not route.room():
            self._until(route.room, self.timeout, lambda: (
                f"peer {peer.index} took none of our last {ipc.RECORDS} commands by "
                f"CUDA IPC within {self.timeout:g} s: is it still running?"))

    def _track(self, transfer):
        """Hold `transfer` (and what it keeps alive) until it is done."""
        self._inflight.append(transfer)
        if len(self._inflight) > self._prune_at:  # now and then: each .done costs a read
            self._inflight = [x for x in self._inflight if not x.done]
            self._prune_at = 2 * len(self._inflight) + 16
        return transfer

    def signal(self, peer, imm):
        """An 8-byte WRITE with `imm` into the peer's signal region: a message that is
        only its immediate (the peer expects it)."""
        return self.write(peer, self._signal, 0, peer.signal, 0, SIGNAL, imm)

    # --- arrivals ------------------------------------------------------------------

    def arrived(self, imm):
        """How many WRITEs with immediate `imm` arrived that no expect() took yet."""
        return native.tx_arrived(self._w, imm) - self._taken.get(imm, 0)

    def expect(self, imm, n, timeout=None):
        """Wait until `n` WRITEs with immediate `imm` have arrived (from any peer, NIC,
        in any order), flush them where the GPU needs it (flush_scope), then take them: a
        later expect(imm, ...) needs new ones. On shm of libfabric 2.x, arrivals from a
        peer that keeps writing are counted once it pauses (README, "Using another
        libfabric")."""
        timeout = self.timeout if timeout is None else timeout
        taken = self._taken.get(imm, 0)
        arrived = lambda: self.arrived(imm)  # noqa: E731

        def why():
            lost = self._w.imm_lost
            full = (f"; the arrival table ({IMM_TABLE} values) is full, {lost} arrivals of "
                    "new values were lost" if lost else "")
            bad = (f"; {self._w.remote_errors} arrivals failed here: "
                   f"{_ffi.string(self._w.remote_error).decode(errors='replace')}"
                   if self._w.remote_errors else "")
            return (f"{arrived()} of {n} WRITEs with immediate {imm} arrived within "
                    f"{timeout:g} s{full}{bad}")
        w, want = self._w, taken + n
        self._until(lambda: native.tx_arrived(w, imm) >= want, timeout, why)
        if self.flush_scope is not None:
            memory.current(self.gpu)  # the flush's target: the calling thread's context
            rc = cuda_driver.flush(self.flush_scope)
            if rc:
                raise TransferError(f"{n} WRITEs with immediate {imm} arrived, but "
                                    f"cuFlushGPUDirectRDMAWrites failed: "
                                    f"{cuda_driver.error_name(rc)}")
        self._taken[imm] = taken + n

    # --- control messages ------------------------------------------------------------

    def send(self, peer, data):
        """SEND `data` (at most fi.max_send bytes) to `peer`'s control endpoint; returns
        once it completed. It carries our engine id as immediate data."""
        data = bytes(data)
        if len(data) > self.max_send:
            raise ValueError(f"a control message of {len(data)} bytes; at most "
                             f"{self.max_send} (fabric.max_send)")
        if not isinstance(peer, Peer) or self._peers.get(peer.id) is not peer:
            raise ValueError("that peer is not one of this engine's (use Engine.connect)")
        self._control.send(peer, data, self.id & ((1 << 8 * min(4, self.cq_data_size)) - 1),
                           self.timeout)

    def recv(self, timeout=None):
        """(the Peer that sent it, or None if not connected yet, the bytes) of the next
        control message."""
        timeout = self.timeout if timeout is None else timeout
        ident, data = self._control.recv(timeout)
        mask = (1 << 8 * min(4, self.cq_data_size)) - 1
        peer = next((p for p in self._peers.values() if p.id & mask == ident), None)
        return peer, data

    # --- groups, watching, stats -------------------------------------------------------

    def group(self, peers):
        return Group(self, peers)

    def watch(self, check):
        """Call `check()` from every wait (e.g. launch.Group.check: raises when another
        rank is gone), so a peer that dies is seen at once, not at the timeout."""
        self._watch.append(check)

    def stats(self):
        w = self._w
        return {"posted": w.posted, "completed": w.completed, "eagain": w.eagain,
                "arrived": w.arrived, "injected": w.injected, "nics": len(self.eps),
                "cuda_ipc_commands": self._ipc_commands,
                "resident_commands": self._copier_field("stand_jobs"),
                "resident_launches": self._copier_field("stand_launches")}

    def _copier_field(self, name):
        copier = getattr(self._routes, "copier", None)
        return getattr(copier.c, name) if copier else 0

    def rest(self):
        """Send the resident copier kernel (resident=True) off the GPU now, within the
        engine's timeout: before a device-wide synchronize, or before timing a kernel that
        should have every SM. The next small prepared command brings it back."""
        if getattr(self._routes, "copier", None):
            self._routes.copier.rest(self.timeout)

    def _check(self):
        if self.rc is not None:
            raise self._failure()

    def _failure(self):
        if self.error is not None:
            return self.error
        w = self._w
        what = {1: "fi_cq_read", 2: "fi_cq_readerr", 3: "a completion for no WRITE in flight",
                4: "out of memory", 5: "an error for no WRITE in flight after injected WRITEs "
                f"({_ffi.string(w.remote_error).decode(errors='replace')})"
                }.get(w.failed_call, "the worker")
        return TransferError(f"the transfer worker stopped on NIC {w.failed_nic}: {what}: "
                             f"{fi.strerror(self.rc)} (ret {self.rc})", self.rc)

    def _until(self, ready, timeout, why):
        """Wait for `ready()`, looking at the worker, the watchers and the control CQ at
        least every CHECK_EVERY meanwhile; sched_yield for the first SPIN, then sleeps that
        grow to 1 ms but stay under a sixteenth of the wait so far: a wait of 1.3 ms that
        slept up to 1 ms at a time was seen 285 us late (Transfer.phases, 64 KiB x 100
        pages on the 2-core VM)."""
        with bounds.Deadline(timeout, why):
            self._wait(ready, timeout, why)

    def _wait(self, ready, timeout, why):
        start = time.monotonic()
        deadline, checked, nap = start + timeout, -CHECK_EVERY, 0.0
        while not ready():
            now = time.monotonic()
            if now - checked >= CHECK_EVERY:
                checked = now
                self._check()
                for check in self._watch:
                    check()
                if self._control.pump():
                    continue
                if now > deadline:
                    raise TimeoutError(why())
            if now - start < HOT:
                continue
            if now - start < SPIN:
                os.sched_yield()
            else:
                nap = min(max(2 * nap, 20e-6), 1e-3, max(20e-6, (now - start) / 16))
                time.sleep(nap)


def pages_of(pages, name, what="page numbers"):
    """`pages` as a contiguous int64 or uint64 array (itself where it is one): ValueError
    unless it is a sequence of integers. offsets_of checks their values."""
    array = np.asarray(pages)
    if array.ndim != 1 or (len(array) and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a sequence of {what}")
    if array.dtype not in (np.int64, np.uint64) or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array, np.uint64 if array.dtype.kind == "u" else np.int64)
    return array


def offsets_of(command, side):
    """The byte offsets (a new uint64 array) of a command's items on `side` (0: source,
    1: destination), built and checked in one pass of C (tx_offsets); refuse() the first
    that is negative or puts its WRITE out of its region."""
    items = command.dst_items if side else command.src_items
    out = np.empty(len(items), np.uint64)
    lengths = command.lengths
    at = native.tx_offsets(_ffi.from_buffer(items), items.dtype.kind == "i", len(items),
                           command.page_size or 1, command.length,
                           _ffi.NULL if lengths is None else _ffi.from_buffer("uint64_t[]", lengths),
                           (command.dst if side else command.src).size,
                           _ffi.from_buffer("uint64_t[]", out))
    if at >= 0:
        refuse(command, side, at)
    return out


def refuse(command, side, at):
    """ValueError for item `at` of the command's `side`, found out of range."""
    items, region = (command.dst_items, command.dst) if side else (command.src_items, command.src)
    paged, item = command.page_size is not None, int(items[at])
    n = int(command.length if command.lengths is None else command.lengths[at])
    where = ("destination", "dst") if side else ("source", "src")
    arg = where[1] + ("_pages" if paged else "_offsets")
    if item < 0:
        what = "page number" if paged else "byte offset"
        raise ValueError(f"{arg} has a negative {what} ({item})")
    if paged:
        raise ValueError(f"{where[0]} page {item} is out of range: the region holds "
                         f"{region.size // command.page_size} pages of {command.page_size} bytes")
    raise ValueError(f"{where[0]} bytes {item}..{item + n} are out of range: the region has "
                     f"{region.size}")


def buffer_of(array):
    """(address, bytes, GPU or None) of a numpy, cupy or torch array, which must be
    contiguous (a registration is one range)."""
    if isinstance(array, np.ndarray):
        if not array.flags.c_contiguous:
            raise ValueError("the array must be contiguous")
        return array.ctypes.data, array.nbytes, None
    if hasattr(array, "data_ptr") and hasattr(array, "is_contiguous"):  # torch
        if not array.is_contiguous():
            raise ValueError("the tensor must be contiguous")
        gpu = array.device.index if array.is_cuda else None
        return array.data_ptr(), array.numel() * array.element_size(), gpu
    if hasattr(array, "data") and hasattr(array, "device") and hasattr(array.data, "ptr"):
        if not array.flags.c_contiguous:  # cupy
            raise ValueError("the array must be contiguous")
        return array.data.ptr, array.nbytes, array.device.id
    raise ValueError(f"cannot register a {type(array).__name__}: numpy, cupy or torch arrays")


def inject_size(infos):
    """The longest WRITE inject=True injects on every NIC: tx_attr.inject_size, 4 KiB on
    shm (prov/shm/src/smr_attr.c SMR_INJECT_SIZE), 0 with GPU memory (smr_hmem_tx_attr).
    None on efa: efa-direct's inject_size is its SENDs' inline buffer and it injects no
    WRITE (prov/efa/src/efa_rma.c: fi_no_rma_inject); efa's RDM endpoint lowers its limit
    for WRITEs below tx_attr.inject_size when it enables zero-copy receive, and only
    asserts it (prov/efa/src/rdm/efa_rdm_ep_fiops.c inject_rma_size, efa_rdm_rma.c)."""
    return min(0 if fi.string(i.fabric_attr.name).startswith("efa") else i.tx_attr.inject_size
               for i in infos)


def per_peer_nic(a, b, count):
    """The NIC both ends of a pair use with spread='per-peer' (one rail per pair): a hash
    of the two ids, the same from either end, spreading a node's peers over its NICs."""
    low, high = sorted((a, b))
    return zlib.crc32(struct.pack("<II", low, high)) % count


def worker_cores(gpu):
    """The GPU's share of its NUMA node's cores (chapter 12), the same whether this process
    sees every GPU or its own alone (topo.layout), or None: best effort."""
    if gpu is None:
        return None
    try:
        buses, _ = topo.gpus_here()
        gpus = topo.layout(buses, [])
        cores = set(gpus[gpu].cores) & os.sched_getaffinity(0)
        return cores or None
    except Exception:  # no topology here: the scheduler decides
        return None

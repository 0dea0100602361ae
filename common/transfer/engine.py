"""The transfer engine itself: Engine, set up, addresses, regions, arrivals, control
messages and waits (see the package's docstring); its WRITE calls are commands.py's, the
byte formats wire.py's, the control endpoint control.py's."""
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
from common.fabric import lib, memory
from common.gpu import cuda_driver
from common.transfer import ipc, wire
from common.transfer._native import ffi as _ffi, lib as native
from common.transfer.commands import RING, Group, Writes
from common.transfer.control import Control
from common.transfer.regions import SIGNAL, Peer, Region, RemoteRegion, buffer_of
from common.transfer.transfers import TransferError

IMM_TABLE = 1 << 14    # distinct immediate values the arrival table holds (a power of two)
NAP_US = 20            # the worker's sleep when idle a while (it yields before that)
# A wait (Engine._until) spins for its first HOT seconds, yields until SPIN, then naps
# (a yield took about 1 us on an H200 box, a resident copier's command 7 us there:
# results/transfer/README.md); it looks at the worker, the watchers and the control CQ
# at least every CHECK_EVERY seconds (each look took 3-5 us there)
HOT, SPIN, CHECK_EVERY = 20e-6, 1e-3, 50e-6
SPREADS = ("round-robin", "per-peer")
CACHE_SIZE = "FI_MR_CACHE_MAX_SIZE"  # see Engine: GPU regions larger than its default
CLOSED = ("this engine is closed (its Closer has run): it connects, registers, sends and "
          "awaits nothing more")


class Engine(Writes):
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
        self.name = fi.name_of(info)  # as Engine(provider=...) names it: shm, tcp, efa-direct
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
        self.rc, self.error = None, None  # the worker's return code; why calls are refused
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
                self._routes = ipc.Routes(self)
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
        # said first: from here on every call is refused (_check), even where the join
        # gives up, rather than made on endpoints and domains that are closing
        self.error = TransferError(CLOSED)
        self._w.stop = 1
        bounds.join([self._thread], "the transfer engine")

    # --- addresses and regions ---------------------------------------------------------

    def address(self):
        """All a peer needs to connect: our id, control address, NIC count, each data
        NIC's address and our signal region's descriptor."""
        self._check()
        inbox = self._inbox.address if self._inbox else b""
        return wire.pack_address(self.id, self.name, fi.getname(self._control.ep), inbox,
                                 [fi.getname(ep) for ep in self.eps], self._signal.descriptor())

    def connect(self, address):
        """The Peer at `address` (another engine's address()): inserted in every AV. Its
        `route` says how GPU pages go to it: "cuda-ipc" where it is on this host and our
        GPU reaches its GPU (ipc.py), else "libfabric"; `why` says why."""
        self._check()
        ident, provider, control, inbox, names, signal = wire.parse_address(address)
        if provider != self.name:  # else a name one provider takes, another's WRITEs lost
            raise ValueError(f"that engine runs on {provider} and this one on {self.name}: "
                             "give both the same provider")
        if len(names) != len(self.eps):
            raise ValueError(f"that engine has {len(names)} NICs and this one "
                             f"{len(self.eps)}: NIC i writes to NIC i, so give both the same "
                             "nics")
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
        self._check()
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
        self._check()
        ptr, size, bases, keys, handle = wire.parse_region(descriptor)
        if len(keys) != len(self.eps):
            raise ValueError(f"that region is registered on {len(keys)} NICs, this engine has "
                             f"{len(self.eps)}: give both engines the same nics")
        return RemoteRegion(ptr, size, bases, keys, handle)

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
        self._check()
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
        self._check()
        data = bytes(data)
        if len(data) > self.max_send:
            raise ValueError(f"a control message of {len(data)} bytes; at most "
                             f"{self.max_send} (Engine.max_send)")
        if not isinstance(peer, Peer) or self._peers.get(peer.id) is not peer:
            raise ValueError("that peer is not one of this engine's (use Engine.connect)")
        self._control.send(peer, data, self.id & ((1 << 8 * min(4, self.cq_data_size)) - 1),
                           self.timeout)

    def recv(self, timeout=None):
        """(the Peer that sent it, or None if not connected yet, the bytes) of the next
        control message."""
        self._check()
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
        """Raise why this engine does nothing more: it is closed, or its worker stopped."""
        if self.error is not None or self.rc is not None:
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

"""The host proxy of chapters 16 and 17: the thread that drives the NICs for the device side.

Its loop is in C (proxy.c, built as common.moe._native; chapter 16 teaches it): the device side
(numpy on the host, or GPU kernels) writes commands into a ring in host memory, the loop
posts them as WRITEs with immediate data and turns each immediate that arrives into a stamp
in an arrival table. This module opens what the loop drives: an endpoint on each NIC of the
rank's GPU (chapter 08's topology, as common/engine/nics.py's rank_nics chooses them), each
peer on one of them (one rail per pair of ranks), the region registered on each, and the
peers' addresses, exchanged through the group.
"""
import os
import struct
import threading
import time

from common import bounds
from common.engine.nics import rank_nics
from common.fabric import memory
from common.gpu import cuda_driver
from common.moe._native import ffi, lib as native
from common.fabric import lib
import common.fabric as fi

RING = 256                 # commands the device side may queue for the proxy
PEER = struct.Struct("<QQH")  # region base, MR key, address length (+ the address)


class Proxy:
    """The host proxy: proxy.c's loop in a thread of its own (GIL released).

    It drives each NIC of this rank (its GPU's, chapter 08's topology; a virtual NIC, one
    more domain of shm or tcp, where there is none) and serves each peer through one of
    them (peer_nic): a p5 GPU's 4 NICs each carry a quarter of its peers."""

    def __init__(self, own, group, mem, stamps_ptr, kinds, provider, timeout, largest,
                 kernels_wait=False, nics=None):
        """stamps_ptr: the arrival table, [kinds][world] uint32 (what an immediate's kind
        says arrived). kernels_wait: GPU kernels, not this host, wait on the stamps
        (chapter 17). nics: how many of its NICs to use (None: all; virtual ones: 1)."""
        self.timeout = timeout
        info, _ = fi.pick(provider, lib.FI_MSG | lib.FI_RMA, hmem=mem.gpu is not None)
        if largest > info.ep_attr.max_msg_size:  # one WRITE per peer, never split
            raise ValueError(f"a WRITE of up to {largest} bytes, more than "
                             f"{fi.provider_of(info)} takes ({info.ep_attr.max_msg_size})")
        self.provider = fi.provider_of(info)
        scope = cuda_driver.flush_scope(self.provider, mem.gpu)
        infos, self.nics = rank_nics(info, group, mem.gpu, nics)
        # at most RING WRITEs in flight per NIC; emulated nodes on one host reach each other by NIC
        domains, self.cqs, avs, eps = zip(*[
            fi.open_endpoint(own, i, cq_size=fi.cq_size_for(i, RING), av_count=group.world,
                             shm=False) for i in infos])
        mrs = [memory.register(own, domain, mem, lib.FI_WRITE | memory.WRITE_TARGET, key=1)
               for domain in domains]
        mine = [(fi.remote_base(i, mem.ptr), fi.mr_key(mr), fi.getname(ep))
                for i, mr, ep in zip(infos, mrs, eps)]
        peers = [unpack_nics(blob) for blob in group.allgather(pack_nics(mine))]
        p = self.p = ffi.new("struct m16_proxy *")
        # the ring and its head in host memory the device side can write (a GPU too)
        self.shared = mem.host_shared(8 + RING * ffi.sizeof("struct m16_write"))
        self.head_at = self.shared.ctypes.data  # where a GPU writing the ring finds it
        self.ring_at, self.ring_size = self.head_at + 8, RING
        at = ffi.cast("char *", self.head_at)
        p.head, p.ring = ffi.cast("uint64_t *", at), ffi.cast("struct m16_write *", at + 8)
        n, world = len(infos), group.world
        self.keep = [ffi.new("struct fid_ep *[]", eps), ffi.new("struct fid_cq *[]", self.cqs),
                     ffi.new("void *[]", [fi.mr_desc(mr) for mr in mrs]),
                     ffi.new("uint32_t[]", world), ffi.new("fi_addr_t[]", world),
                     ffi.new("uint64_t[]", world), ffi.new("uint64_t[]", world),
                     ffi.new("struct fi_context2[]", RING), ffi.new("uint8_t[]", RING)]
        (p.eps, p.cqs, p.descs, p.nic, p.addr, p.remote_base, p.remote_key, p.contexts,
         p.busy) = self.keep
        far = [r for r in range(world) if r // group.ranks_per_node != group.node]
        for r, (i, (base, key, name)) in routes(group.rank, n, peers, far).items():
            p.nic[r], p.remote_base[r], p.remote_key[r] = i, base, key
            p.addr[r] = fi.av_insert(avs[i], name)
        p.nics, p.base = n, ffi.cast("char *", mem.ptr)
        p.ring_size, p.world, p.kinds = RING, world, kinds
        p.arrived = ffi.cast("uint32_t *", stamps_ptr)
        if kernels_wait and self.provider == "shm":  # its CUDA copies: see m16_settle
            p.settle = ffi.cast("int (*)(void *)", mem.legacy_stream_sync())
        if scope is not None:
            p.flush = ffi.cast("int (*)(int, int)", cuda_driver.flush_address())
            p.flush_scope = scope
        self.rc, self.error, self.gpu = None, None, mem.gpu
        self.thread = threading.Thread(target=self._run, daemon=True, name="proxy")
        own.callback(self.stop)  # before the endpoint closes (the Closer runs backwards),
        self.thread.start()      # and before it starts: a Ctrl-C may come in between

    def _run(self):
        try:
            if self.gpu is not None:  # libfabric's CUDA copies use this thread's GPU
                memory.use_gpu(self.gpu)  # (left at GPU 0, shm stages via host memory)
            self.rc = native.m16_proxy_run(self.p)
        except Exception as e:  # said by the main thread, in one line, at its next check
            self.error, self.rc = e, -lib.FI_EOTHER

    def submit(self, group, local, remote, length, peer, imm):
        """Queue one WRITE; waits (bounded) while the ring is full."""
        with bounds.Deadline(self.timeout, "no room in the proxy's ring within "
                             f"{self.timeout:g} s") as deadline:
            while self.p.head[0] - native.m16_completed(self.p) >= RING:
                self.check(group, deadline.at, "room in the proxy's ring")
        native.m16_submit(self.p, local, remote, length, peer, imm)

    def check(self, group, deadline, what):
        """Between two looks at what we wait for: the proxy's health, the peers', the clock
        (None: the caller watches it)."""
        if self.rc is not None:
            raise self.failure()
        group.check()
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {self.timeout:g} s")
        os.sched_yield()

    def failure(self):
        if self.error is not None:
            return self.error
        call = {1: "fi_writemsg", 2: "fi_cq_read", 3: "fi_cq_read"}.get(self.p.failed_call, "")
        if self.rc == -lib.FI_EAVAIL:  # a failed WRITE: its entry and the provider's text
            try:
                fi.cq_read(self.cqs[self.p.failed_nic], fi.cq_entries(1))
            except fi.FabricError as e:
                return e
        if self.p.failed_call == 3:
            return ValueError("the proxy got a completion for no WRITE in flight")
        if self.p.failed_call in (4, 5):
            return ValueError(settle_failure(self.p))
        return fi.FabricError(f"{call} (in the proxy)", self.rc)

    def drain(self, group):
        """Wait until every WRITE we queued has completed: its source may be reused."""
        with bounds.Deadline(self.timeout, "no completion of our WRITEs within "
                             f"{self.timeout:g} s") as deadline:
            while native.m16_completed(self.p) < self.p.head[0]:
                self.check(group, deadline.at, "completion of our WRITEs")

    def stop(self):
        self.p.stop = 1
        bounds.join([self.thread], "the proxy")


NICS = struct.Struct("<H")  # how many NICs a rank's proxy has; then a PEER for each


def pack_nics(nics):
    """[(region base, MR key, address)] of a rank's NICs, as bytes for the allgather."""
    return NICS.pack(len(nics)) + b"".join(PEER.pack(base, key, len(name)) + name
                                           for base, key, name in nics)


def unpack_nics(blob):
    (count,), at, nics = NICS.unpack_from(blob), NICS.size, []
    for _ in range(count):
        base, key, length = PEER.unpack_from(blob, at)
        at += PEER.size
        nics.append((base, key, blob[at:at + length]))
        at += length
    return nics


def peer_nic(rank, peer, count):
    """Which of `count` NICs `rank` reaches `peer` through, and (with the peer's count)
    which of the peer's it writes to. Both ends of a pair pick the same index (a NIC and
    its counterpart: one rail), each rank's peers spread evenly over its NICs, and so do
    the senders that write to one rank (peer % count alone would put them all on one)."""
    return (rank + peer) % count


def routes(rank, count, peers, far):
    """{peer: (which of our `count` NICs, (region base, MR key, address) of the peer's NIC
    it writes to)} for the peers in `far`; `peers`: every rank's NICs (unpack_nics)."""
    return {r: (peer_nic(rank, r, count), peers[r][peer_nic(rank, r, len(peers[r]))])
            for r in far}


def settle_failure(p):
    """What m16_settle's failure (p.failed_call 4 or 5) means, in one line."""
    if p.failed_call == 4:
        return f"the proxy's cudaStreamSynchronize failed (CUDA error {p.settle_error})"
    return (f"the proxy's cuFlushGPUDirectRDMAWrites failed: "
            f"{cuda_driver.error_name(p.settle_error)}")

"""Chapter 16 - moe: the expert-parallel all-to-all (dispatch / combine) with a host proxy.

What you will learn: how a MoE layer's tokens travel. Each rank holds some
tokens, each routed to `topk` of `experts` experts, and hosts experts / world
of the experts. dispatch sends every token to the ranks hosting its experts,
which receive them expert by expert, contiguous, ready for a grouped GEMM;
combine sends each expert's output back to the token's rank, which adds them
up, weighted by the router. Both are split into a send half and a receive
half, so other work (shared experts) can run in between.

The protocol is the one Perplexity built on libfabric for EFA: a receiver
cannot know where to put a sender's tokens before it knows how many come from
everyone, so each sender first ships its per-expert counts, and with them its
first tokens, into a small private slot that each receiver keeps per sender.
Once every rank has every count, each knows all offsets, and the rest go with
one WRITE per peer into one contiguous region. combine needs no counts (the
offsets are known by then): one WRITE per peer, summed on the receiver. Its
signal from every peer is also the barrier that keeps the next dispatch from
overwriting a slot before it was read.

Peers on the same (emulated) node are written directly, through shared memory
(CUDA IPC over NVLink on GPUs); peers on other nodes through libfabric WRITEs
with immediate data, posted by a host proxy thread in C (chapters/16_moe.c,
GIL released) that the device side feeds through a ring in host memory. Data
that arrived is one thing to wait for, whichever way it came: a stamp in an
arrival table, written by the node peer, or by the proxy from an immediate.
A proxy drives every NIC of its rank's GPU (chapter 08's topology: 4 on a p5)
and shards the peers over them, each pair of ranks on one NIC index at both
ends; without NICs, --nics N virtual ones (domains of shm or tcp). Where a NIC
writes into GPU memory itself, the proxy flushes those writes before it stamps
if the device does not order them for its own kernels (cuFlushGPUDirectRDMAWrites).

New since chapter 07 (08's topology aside): ranks and a rendezvous
(common/launch.py, scripts/launch.py, or torchrun / Slurm variables); fp8
e4m3 with block scales and bf16 (common/moe/reference.py, also the reference
every run is checked against); the proxy; --device cpu, where numpy stands in
for the kernels and host memory for GPU memory.

--device cuda keeps the data in GPU memory, and the GPU drives it all
(common/moe/nvlink.py and the kernels of chapters/16_moe.cu): kernels count, push each row
over NVLink into its receiver's memory and raise a flag; rows for another node go into an
outbox laid out as they will land, and the kernels queue the WRITEs in the proxy's ring
themselves and poll the stamps the peer's proxy leaves; the receiver's kernels wait and
gather; the host only launches and waits once per receive half. That changes one thing in
the protocol: each sender owns a stripe of the receiver's region, so nobody waits for the
counts before sending the rest. --drive host runs this file's host-driven protocol on GPUs
too (cupy packs, the host copies, stamps and waits). --counts device leaves the counts on
the GPU: dispatch-recv returns at once, with the whole receive buffers, as the published
kernels do, so the host never waits in dispatch. --baseline nccl checks and times NCCL
doing the whole job. On 2 x H200 (CUDA-enabled libfabric 2.1.0, 2 ranks) at the decode
shape (128 tokens), dispatch / combine: one node 100 / 77 us (78 / 68 with --counts device),
two over libfabric shm 154 / 125 us (97 / 103), NCCL 1272 / 643 us (these at 09ab98f),
host-driven 1602 / 756 us (at f6fe2b2; notebooks/README.md has the table).

    .venv/bin/python scripts/launch.py -n 4 chapters/16_moe.py                       # one node
    .venv/bin/python scripts/launch.py -n 4 --ranks-per-node 2 chapters/16_moe.py -p shm
    .venv/bin/python scripts/launch.py -n 4 --ranks-per-node 2 chapters/16_moe.py -p shm --nics 2
    .venv/bin/python scripts/launch.py -n 8 --ranks-per-node 4 chapters/16_moe.py -p tcp \\
        --max-tokens 16 --hidden 256 --experts 32 --topk 4 --iters 0       # checks only
    .venv/bin/python scripts/launch.py -n 2 chapters/16_moe.py --check none --tokens 1,8,32,128 --json
    .venv/bin/python scripts/launch.py -n 2 --gpus 0,1 chapters/16_moe.py --device cuda --baseline nccl
    .venv/bin/python scripts/launch.py -n 2 --gpus 0,1 chapters/16_moe.py --device cuda --counts device
    torchrun --nproc-per-node 8 chapters/16_moe.py ...                     # a cluster

Transcript (2-core x86_64 VM, no GPU, no NIC, Debian's libfabric 1.17; 4 ranks as 2
emulated nodes of 2, so each rank has one peer through shared memory and two through shm
WRITEs; the decode shape; 4 ranks and their proxies share the 2 cores with other programs
(load average 3.0 before the run, 7.3 after), so latency varies by 2x and more from run to
run; four of the bf16 check lines left out; commit 51c3160):

    $ .venv/bin/python scripts/launch.py -n 4 --ranks-per-node 2 chapters/16_moe.py -p shm
    launch: 4 ranks, 2 per node (2 nodes); pids 23351 23354 23357 23360
    [0] 4 ranks (scripts/launch.py), 2 emulated nodes of 2; device cpu: numpy, host memory; same node: shared memory; other nodes: libfabric WRITEs through the proxy
    [0] check fp8 overflow     private 1: 4096 (token, expert) rows received, counts exact and each row once with its scales on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 3.20e-02)
    [0] check fp8 random       private 8: 4096 (token, expert) rows received, counts exact and each row once with its scales on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 3.20e-02)
    [0] check fp8 empty-expert private 8: 4096 (token, expert) rows received, counts exact and each row once with its scales on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 3.29e-02)
    [0] check fp8 silent-rank  private 8: 3072 (token, expert) rows received, counts exact and each row once with its scales on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 3.20e-02)
    [0] check fp8 one-expert   private 8: 4096 (token, expert) rows received, counts exact and each row once with its scales on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 1.99e-02)
    [0] check fp8 fewer        private 8: 1640 (token, expert) rows received, counts exact and each row once with its scales on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 3.19e-02)
    [0] check bf16 overflow     private 1: 4096 (token, expert) rows received, counts exact and each row once on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 3.20e-02)
    [0] check bf16 fewer        private 8: 1640 (token, expert) rows received, counts exact and each row once on 4 of 4 ranks; combine max |error| 0.00e+00 (bf16 tolerance 3.19e-02)
    [0] all checks passed (seed 2827431768)
    [0] provider: shm; proxy of rank 0: 1 virtual NIC, each a domain of shm (no NIC with a PCI address here)
    [0] benchmark ours: 128 tokens per rank, hidden 7168, top-8 of 256 experts, fp8 dispatch (7392 B per row) / bf16 combine (14336 B); 20 iterations after 3
    [0] proxy of rank 0: 138 WRITEs, -FI_EAGAIN 0 times
    [0] latency, the median of each rank, then across ranks:
    [0]   dispatch send  p50  289650.6 us   max  305036.3 us
    [0]   dispatch recv  p50   11665.2 us   max   16001.0 us
    [0]   dispatch       p50  307902.8 us   max  322442.2 us   0.025 GB/s (1024 rows x 7392 B / p50)
    [0]   combine send   p50  157546.2 us   max  163114.5 us
    [0]   combine recv   p50  167989.5 us   max  187375.8 us
    [0]   combine        p50  345467.8 us   max  379450.7 us   0.042 GB/s (1024 rows x 14336 B / p50)

On --device cpu the latencies are those of numpy on two shared cores (quantising, packing
and copying megabytes per rank), not what the protocol costs on GPUs.
"""
# What shows this chapter's lesson and when it counts as shown: scripts/tour.py runs it
# and says whether it showed on your machine.
LESSON = {"figure": "check", "shows": "dispatch and combine exact on 4 ranks / 2 nodes"}

# %% [markdown]
# ## Motivation
#     rank s (sender)                                   rank d (receiver)
#     dispatch-send: count tokens per expert, pack them per peer
#       [counts | first P tokens] ----------------->   private slot s   (every peer)
#       ... all counts in: every offset known ...
#       [the rest] ---- one WRITE per peer -------->   overflow region, at s's offset
#     dispatch-recv:                                    wait, copy out expert-major
#                                                       (grouped GEMM, here x -> k_e * x)
#     combine-recv: weighted sum      <------------    combine-send: one WRITE per peer
#
#     same node: copy into the peer's mapped memory, then stamp its arrival table
#     other node: a command in the proxy's ring -> fi_writemsg + immediate data;
#                 the peer's proxy turns the immediate into the same stamp

# %%
import argparse
import os
import struct
import sys
import threading
import time

import numpy as np

from common import bench, cli, launch
from common.engine import multinet, topo
from common.fabric import cuda_driver, memory
from common.moe import reference as ref
from common._native16 import ffi, lib as native
from common.moe.bookkeeping import Shape, Stages, Wire, aligned, check_shape, check_tokens, \
    receive_plan, send_plan, weighted_sum
from common.moe.memory import DEVICES, Region
from common.moe.nccl import NcclAllToAll
from common.moe.nvlink import NvlinkAllToAll
from common.fabric import lib
import common.fabric as fi

COUNTS, OVERFLOW, COMBINE = range(3)  # what a stamp says arrived (the immediate's kind)
KINDS = 3
RING = 256                 # commands the device side may queue for the proxy
PEER = struct.Struct("<QQH")  # region base, MR key, address length (+ the address)
KERNELS = os.path.splitext(os.path.abspath(__file__))[0] + ".cu"  # 16_moe.cu, for cuda


# %% [markdown]
# ## Code

# %%
class Layout(Shape):
    """Where everything is in a rank's data region: the same offsets on every rank."""

    def __init__(self, world, experts, max_tokens, topk, hidden, dtype, private):
        super().__init__(world, experts, max_tokens, topk, hidden, dtype)
        self.private = private
        self.header = aligned(4 * experts)  # a sender's counts, one int32 per expert
        self.slot = self.header + private * self.row
        sections = [("slots", world * self.slot),
                    ("overflow", world * self.per_peer * self.row),
                    ("combine_in", max_tokens * topk * self.out_row),
                    ("signal_in", 8 * world),
                    ("send", world * self.header + max_tokens * topk * self.row),
                    ("combine_out", world * self.per_peer * self.out_row)]
        self.lay_out(sections)


class Proxy:
    """The host proxy: chapters/16_moe.c's loop in a thread of its own (GIL released).

    It drives each NIC of this rank (its GPU's, chapter 08's topology; a virtual NIC, one
    more domain of shm or tcp, where there is none) and serves each peer through one of
    them (peer_nic): a p5 GPU's 4 NICs each carry a quarter of its peers."""

    def __init__(self, own, group, mem, stamps_ptr, provider, timeout, largest,
                 kernels_wait=False, nics=None):
        """kernels_wait: GPU kernels, not this host, wait on the stamps (common/moe/nvlink.py).
        nics: how many of its NICs to use (None: all; virtual ones: 1)."""
        self.timeout = timeout
        info, _ = fi.pick(provider, lib.FI_MSG | lib.FI_RMA, hmem=mem.gpu is not None)
        if largest > info.ep_attr.max_msg_size:  # one WRITE per peer, never split
            raise ValueError(f"a WRITE of up to {largest} bytes, more than "
                             f"{fi.provider_of(info)} takes ({info.ep_attr.max_msg_size})")
        self.provider = fi.provider_of(info)
        scope = flush_scope(self.provider, mem.gpu)
        infos, self.nics = proxy_nics(info, group, mem.gpu, nics)
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
        at = ffi.cast("char *", self.shared.ctypes.data)
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
        p.ring_size, p.world, p.kinds = RING, world, KINDS
        p.arrived = ffi.cast("uint32_t *", stamps_ptr)
        if kernels_wait and self.provider == "shm":  # its CUDA copies: see m16_settle
            p.settle = ffi.cast("int (*)(void *)", mem.legacy_stream_sync())
        if scope is not None:
            p.flush = ffi.cast("int (*)(int, int)", cuda_driver.flush_address())
            p.flush_scope = scope
        self.rc, self.error, self.gpu = None, None, mem.gpu
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        own.callback(self.stop)  # before the endpoint closes (the Closer runs backwards)

    def _run(self):
        try:
            if self.gpu is not None:  # libfabric's CUDA copies use this thread's GPU
                memory.use_gpu(self.gpu)  # (left at GPU 0, shm stages via host memory)
            self.rc = native.m16_proxy_run(self.p)
        except Exception as e:  # said by the main thread, in one line, at its next check
            self.error, self.rc = e, -lib.FI_EOTHER

    def submit(self, group, local, remote, length, peer, imm):
        """Queue one WRITE; waits (bounded) while the ring is full."""
        deadline = time.monotonic() + self.timeout
        while self.p.head[0] - native.m16_completed(self.p) >= RING:
            self.check(group, deadline, "room in the proxy's ring")
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
        deadline = time.monotonic() + self.timeout
        while native.m16_completed(self.p) < self.p.head[0]:
            self.check(group, deadline, "completion of our WRITEs")

    def stop(self):
        self.p.stop = 1
        self.thread.join()


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


def proxy_nics(head, group, gpu, count=None):
    """The fi_info of each NIC this rank's proxy drives, and a line saying which: its GPU's
    NICs (chapter 08's topology; for host memory an even share of the node's), the first
    `count` of them; or `count` (default 1) virtual NICs where no NIC has a PCI address."""
    nics = topo.nics_here(head)
    provider = fi.provider_of(head)
    if not nics:
        count = count or 1
        return [head] * count, (f"{count} virtual NIC{'s' * (count > 1)}, each a domain of "
                                f"{provider} (no NIC with a PCI address here)")
    gpu_buses = topo.gpus_here()[0] if gpu is not None else []
    mine = topo.rank_nics(nics, gpu_buses, gpu, group.rank % group.ranks_per_node,
                          group.ranks_per_node)
    mine = topo.take([mine], count)[0]
    entries = multinet.lane_entries(head)  # of each NIC, an entry of the head's kind
    other = [n.name for n in mine if n.name not in entries]
    if other:
        raise ValueError(f"NIC {other[0]} is not in fabric {fi.string(head.fabric_attr.name)} "
                         "with the first entry's address format")
    whose = f"GPU {gpu}'s" if gpu is not None else "a share of the node's"
    return ([entries[n.name] for n in mine],
            f"{len(mine)} NIC{'s' * (len(mine) > 1)} ({whose}): {' '.join(n.name for n in mine)}")


# Providers that copy the bytes themselves (the CPU, or CUDA calls: see m16_settle): no
# NIC writes into GPU memory behind the GPU's back.
COPYING = {"shm", "sm2", "tcp", "udp", "sockets", "net"}


def flush_scope(provider, gpu, attribute=None):
    """The scope the proxy flushes GPUDirect RDMA writes to before it stamps; None when
    there is nothing to flush. Only a NIC writes into GPU memory by itself, and what reads
    it next is the GPU that owns it (its kernels, or the copies the host asks of it):
    covered where the device orders such writes for their owner at least
    (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING; "owner" on the H200s). NCCL
    asks the same. `attribute(which, gpu)`: cuda_driver.attribute, or a test's."""
    if gpu is None or provider.split(";")[0] in COPYING:
        return None
    attribute = attribute or cuda_driver.attribute
    if attribute(cuda_driver.WRITES_ORDERING, gpu) >= cuda_driver.OWNER:
        return None
    if not attribute(cuda_driver.FLUSH_OPTIONS, gpu) & cuda_driver.FLUSH_OPTION_HOST:
        raise ValueError(f"GPU {gpu} neither orders GPUDirect RDMA writes nor can flush them "
                         "(cuFlushGPUDirectRDMAWrites): a stamp could run ahead of its data")
    return cuda_driver.OWNER


def settle_failure(p):
    """What m16_settle's failure (p.failed_call 4 or 5) means, in one line."""
    if p.failed_call == 4:
        return f"the proxy's cudaStreamSynchronize failed (CUDA error {p.settle_error})"
    return (f"the proxy's cuFlushGPUDirectRDMAWrites failed: "
            f"{cuda_driver.error_name(p.settle_error)}")


class AllToAll(Stages):
    """dispatch and combine for one layer shape; each split into a send and a receive half."""

    def __init__(self, own, group, max_tokens, experts, topk, hidden, dispatch_dtype="fp8",
                 private_tokens=8, provider=None, timeout=30.0, device="cpu",
                 combine_dtype="bf16", nics=None):
        check_shape(group.world, max_tokens, experts, topk, hidden, dispatch_dtype,
                    private_tokens, combine_dtype)
        self.group, self.timeout = group, timeout
        self.L = L = Layout(group.world, experts, max_tokens, topk, hidden, dispatch_dtype,
                            private_tokens)
        self.mem = mem = DEVICES[device](own, group, L.size, KERNELS)
        self.xp, self.wire = mem.xp, Wire(dispatch_dtype, hidden, mem)
        # the arrival table, [kind][source]: host memory, stamped by node peers and our proxy
        size = 4 * KINDS * group.world
        table = Region(group.job, f"{group.rank}-stamps", size)
        own.callback(table.unlink)
        largest = max(L.slot, L.per_peer * L.row, max_tokens * topk * L.out_row)
        self.proxy = (Proxy(own, group, mem, table.ptr, provider, timeout, largest,
                            nics=nics) if group.nodes > 1 else None)
        handles = group.allgather(mem.handle())  # every region exists: map the node's
        node = [r for r in range(group.world) if r // group.ranks_per_node == group.node]
        self.peer = {r: mem.mine if r == group.rank else mem.open(own, r, handles[r])
                     for r in node}
        self.tables = {r: table.bytes if r == group.rank else
                       Region.peer(group.job, f"{r}-stamps", size) for r in node}
        self.table = {r: ffi.cast("uint32_t *", t.ctypes.data) for r, t in self.tables.items()}
        group.barrier()  # every region is mapped by its node: the names can go
        mem.published()
        table.unlink()
        self.round, self.stamping = 0, []

    # --- moving bytes: the node's shared memory, or the proxy ---------------------
    def put(self, kind, dest, local, remote, length):
        """Send `length` bytes at `local` in our region to `remote` in dest's, and let dest
        know (stamp `kind`); a node peer's stamp waits for flush(). Nothing to send still
        stamps: the stamp is the signal."""
        g = self.group
        if dest in self.peer:
            if length:
                self.mem.copy(self.peer[dest], remote, local, length)
            self.stamping.append((dest, kind))
            return
        if length == 0:  # a WRITE needs bytes: 8 into the sender's signal word
            local = remote = self.L.signal_in + 8 * g.rank
            length = 8
        imm = kind << 30 | g.rank << 14 | self.stamp
        self.proxy.submit(g, local, remote, length, dest, imm)

    def flush(self):
        """The node peers' copies are done: stamp them (a release store, in C: the bytes
        are visible before the stamp)."""
        g = self.group
        self.mem.ready()
        for dest, kind in self.stamping:
            native.m16_set_stamp(self.table[dest], kind * g.world + g.rank, self.stamp)
        self.stamping = []

    def wait(self, kind, sources, what):
        """Until every one of `sources` has stamped `kind` for this round (acquire loads,
        in C: what a stamp announces is read after it)."""
        g = self.group
        deadline = time.monotonic() + self.timeout
        sources = np.asarray(sources, dtype=np.int64)
        row, listed = self.table[g.rank] + kind * g.world, ffi.cast("int64_t *",
                                                                    sources.ctypes.data)
        while not native.m16_all_stamped(row, listed, len(sources), self.stamp):
            if time.monotonic() > deadline:  # name who is late: hung, or far behind
                seen = self.tables[g.rank].view(np.uint32)[kind * g.world + sources]
                late = ", ".join(str(r) for r in sources[seen != self.stamp])
                raise TimeoutError(f"no {what} from rank {late} within {self.timeout:g} s")
            if self.proxy:
                self.proxy.check(self.group, None, what)
            else:
                self.group.check()
                os.sched_yield()
        self.mem.settle()

    # --- dispatch -------------------------------------------------------------------
    def dispatch_send(self, x, indices):
        """Count, pack, send the counts with the first tokens, then (once every count is
        in) the rest, one WRITE per peer. x: (n, hidden) float32; indices: (n, topk)."""
        L, g, xp = self.L, self.group, self.xp
        indices = check_tokens(xp, x, indices, L)
        self._stage("idle", "dispatch sent")
        self.round += 1
        self.stamp = self.round % 0x3FFF + 1  # 14 bits, never 0 (a fresh table's value)
        self.order, counts = send_plan(xp, indices, L.experts)
        self.per_dest = counts.reshape(L.world, L.local).sum(axis=1)
        packed = self.wire.encode(x)[self.order // L.topk]
        # send region: for each peer, [our counts | its tokens]
        seg = L.send + np.concatenate([[0], np.cumsum(L.header + self.per_dest * L.row)])
        first = np.concatenate([[0], np.cumsum(self.per_dest)])
        data, header = self.mem.data, xp.asarray(counts).view(xp.uint8)
        for d in range(L.world):
            data[seg[d]:seg[d] + 4 * L.experts] = header
            data[seg[d] + L.header:seg[d + 1]] = packed[first[d]:first[d + 1]].ravel()
        self.mem.ready()  # packed: the proxy may read it
        for d in self._peers_in_turn():
            ahead = min(int(self.per_dest[d]), L.private)
            self.put(COUNTS, d, seg[d], L.slots + g.rank * L.slot, L.header + ahead * L.row)
        self.flush()
        self.wait(COUNTS, range(L.world), "counts")
        slots = data[L.slots:L.slots + L.world * L.slot].reshape(L.world, L.slot)
        self.matrix = np.ascontiguousarray(self.mem.host(slots[:, :4 * L.experts])).view(
            np.int32)  # [source, expert]
        into = self.matrix.reshape(L.world, L.world, L.local).sum(axis=2)  # [source, dest]
        beyond = np.maximum(into - L.private, 0)
        for d in self._peers_in_turn():
            if beyond[g.rank, d]:
                at = int(beyond[:g.rank, d].sum())  # after the senders before us
                self.put(OVERFLOW, d, seg[d] + L.header + L.private * L.row,
                         L.overflow + at * L.row, int(beyond[g.rank, d]) * L.row)
        self.flush()
        self.n_tokens = len(indices)

    def dispatch_recv(self):
        """Wait for the overflow, then lay the tokens out expert-major. Returns
        (tokens, scales, counts per local expert on the host); scales is None for bf16."""
        L, g, xp = self.L, self.group, self.xp
        self._stage("dispatch sent", "dispatched")
        self.from_each, gather, counts = receive_plan(self.matrix, g.rank, L.local)
        overflowing = np.nonzero(self.from_each > L.private)[0]
        self.wait(OVERFLOW, overflowing, "overflow tokens")
        for s in overflowing:  # counts and combine stamp every round, overflow not: a stamp
            # left here could equal a round's 16383 rounds later and pass for fresh
            native.m16_set_stamp(self.table[g.rank], OVERFLOW * g.world + int(s), 0)
        data = self.mem.data
        at, streams = 0, []
        for s in range(L.world):  # each sender's tokens for us, in its order
            n = int(self.from_each[s])
            ahead = min(n, L.private)
            start = L.slots + s * L.slot + L.header
            streams.append(data[start:start + ahead * L.row].reshape(ahead, L.row))
            if n > ahead:
                start = L.overflow + at * L.row
                streams.append(data[start:start + (n - ahead) * L.row].reshape(n - ahead, L.row))
                at += n - ahead
        rows = xp.concatenate(streams) if streams else xp.zeros((0, L.row), xp.uint8)
        self.gather = xp.asarray(gather)
        tokens, scales = self.wire.split(rows[self.gather])
        return tokens, scales, counts

    # --- combine --------------------------------------------------------------------
    def combine_send(self, expert_out):
        """Send each expert output (expert-major, as dispatch_recv gave the tokens;
        float32, sent as bf16) back to its token's rank: one WRITE per peer."""
        L, g, xp = self.L, self.group, self.xp
        rows = len(self.gather) if self.stage == "dispatched" else None
        if rows is not None and expert_out.shape != (rows, L.hidden):
            raise ValueError(f"expert outputs must be ({rows}, {L.hidden}), "
                             f"got {expert_out.shape}")
        self._stage("dispatched", "combine sent")
        out = xp.empty((len(self.gather), L.hidden), xp.uint16)
        out[self.gather] = ref.to_bf16(expert_out)  # back in each sender's order
        self.mem.data[L.combine_out:L.combine_out + out.size * 2] = out.view(xp.uint8).ravel()
        self.mem.ready()
        start = np.concatenate([[0], np.cumsum(self.from_each)])
        into = self.matrix.reshape(L.world, L.world, L.local).sum(axis=2)  # [source, dest]
        for s in self._peers_in_turn():
            at = int(into[s, :g.rank].sum())  # where the sender packed its tokens for us
            self.put(COMBINE, s, L.combine_out + int(start[s]) * L.out_row,
                     L.combine_in + at * L.out_row, int(self.from_each[s]) * L.out_row)
        self.flush()

    def combine_recv(self, weights):
        """Wait for every peer (also the barrier before the next dispatch), then the
        weighted sum. weights: (n, topk); returns (n, hidden) float32."""
        L = self.L
        n = self.n_tokens if self.stage == "combine sent" else None
        if n is not None and weights.shape != (n, L.topk):
            raise ValueError(f"weights must be ({n}, {L.topk}), got {weights.shape}")
        self._stage("combine sent", "idle")
        self.wait(COMBINE, range(L.world), "combine outputs")
        if self.proxy:
            self.proxy.drain(self.group)  # our send region may be reused from here on
        rows = self.mem.data[L.combine_in:L.combine_in + n * L.topk * L.out_row]
        return weighted_sum(self.xp, rows, self.order, weights, L.hidden)

    def _peers_in_turn(self):
        """Every rank, ours first and then the ones after it, so that all do not hit
        rank 0 first."""
        g = self.group
        return [(g.rank + i) % g.world for i in range(g.world)]


# %% [markdown]
# ## Check
# Every rank can compute every rank's input from the seed, so each checks what
# it received against the reference alone; the verdicts are gathered on rank 0.

# %%
def check_case(a2a, case, seed):
    """One round of dispatch and combine for `case`: (ok, what this rank saw). Everything
    the GPU needs is on it before the round and everything is read back after it: with
    counts on the device, the host makes no blocking CUDA call in between (see
    common/moe/nvlink.py)."""
    L, g, xp, host, dtype = a2a.L, a2a.group, a2a.xp, a2a.mem.host, a2a.wire.dtype
    routing = [ref.routing(case, seed, r, L.world, L.max_tokens, L.experts, L.topk)
               for r in range(L.world)]
    inputs = [ref.tokens(seed, r, len(routing[r][0]), L.hidden) for r in range(L.world)]
    indices, weights = routing[g.rank]
    sent = [r[0] for r in routing]
    expected, expected_counts = ref.dispatch(g.rank, L.world, L.experts, sent,
                                             [ref.wire_rows(dtype, x) for x in inputs])
    # the experts: x -> factor(e) * x, on what should arrive, one row more for every row
    # a rank may be handed (the buffers, or wrong counts)
    trips = [ref.round_trip(dtype, x) for x in inputs]  # what each rank's tokens become
    values, _ = ref.dispatch(g.rank, L.world, L.experts, sent, trips)
    first = g.rank * L.local
    experts = np.repeat(np.arange(first, first + L.local), expected_counts)
    answers = np.zeros((L.world * L.per_peer, L.hidden), np.float32)
    answers[:len(values)] = ref.expert_factor(experts, L.experts).astype(np.float32)[:, None] \
        * values
    answers, x, chosen, weighed = (xp.asarray(a) for a in (answers, inputs[g.rank], indices,
                                                          weights))
    a2a.dispatch_send(x, chosen)
    tokens, scales, counts = a2a.dispatch_recv()
    a2a.combine_send(answers[:len(tokens)])
    out = host(a2a.combine_recv(weighed))
    counts = host(counts).astype(np.int64)
    n = int(counts.sum())  # the rows received (the buffers may hold more)
    got = host(tokens[:n]).view(np.uint8)
    if scales is not None:
        got = np.concatenate([got, host(scales[:n]).view(np.uint8)], axis=1)
    counts_ok = np.array_equal(counts, expected_counts)
    rows_ok = counts_ok and got.shape == expected.shape and np.array_equal(got, expected)
    wanted = np.stack([ref.from_bf16(ref.to_bf16(ref.expert_factor(indices[:, j], L.experts)
                                                 [:, None].astype(np.float32) * trips[g.rank]))
                       for j in range(L.topk)], axis=1)
    want = ref.combine(indices, weights, wanted)
    error = float(np.abs(out - want).max()) if out.size else 0.0
    tolerance = 2.0 ** -8 * max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    ok = counts_ok and rows_ok and error <= tolerance
    return ok, {"received": n, "counts": counts_ok, "rows": rows_ok, "error": error,
                "tolerance": tolerance}


def run_checks(build, group, args, cases, name=""):
    """Each case on fresh random inputs, for each dtype; rank 0 says what all saw."""
    seed = int.from_bytes(group.allgather(struct.pack("<Q", args.seed))[0], "little")
    # our overflow case shrinks the private slots (the baseline has none)
    private_of = {c: 1 if c == "overflow" and not name else args.private_tokens for c in cases}
    failed = 0
    for dtype in args.dtypes:
        for private in sorted(set(private_of.values())):
            with fi.Closer() as own:
                a2a = build(own, dtype, private)
                for case in [c for c in cases if private_of[c] == private]:
                    ok, seen = check_case(a2a, case, seed)
                    verdicts = [struct.unpack("<?Qdd", v) for v in group.allgather(
                        struct.pack("<?Qdd", ok, seen["received"], seen["error"],
                                    seen["tolerance"]))]
                    bad = [r for r, v in enumerate(verdicts) if not v[0]]
                    failed += bool(bad)
                    if group.rank == 0:
                        received = sum(v[1] for v in verdicts)
                        worst = max(v[2] for v in verdicts)
                        print(f"check {name}{dtype} {case:<12} private {private}: "
                              f"{received} (token, expert) rows received, counts exact and "
                              f"each row once{' with its scales' if dtype == 'fp8' else ''} on "
                              f"{group.world - len(bad)} of {group.world} ranks; combine "
                              f"max |error| {worst:.2e} (bf16 tolerance "
                              f"{max(v[3] for v in verdicts):.2e})"
                              + (f"; FAILED on ranks {bad}" if bad else ""), flush=True)
                    if not ok:
                        print(f"rank {group.rank}: {case}: {seen}", flush=True)
                group.barrier()  # every WRITE completed everywhere before endpoints close
    if failed:
        raise ValueError(f"{failed} checks failed (seed {seed}: --seed {seed} repeats them)")
    if group.rank == 0:
        print(f"all checks passed (seed {seed})", flush=True)


# %% [markdown]
# ## Benchmark
# Latency of each half and of the whole, per rank (median over iterations), then
# p50 and max across ranks. Bytes, as published figures count them: one row
# per (token, expert) selection, dispatch (hidden + hidden / 128 * 4) bytes in
# fp8 or 2 * hidden in bf16, combine 2 * hidden.

# %%
PHASES = ("dispatch send", "dispatch recv", "dispatch", "combine send", "combine recv",
          "combine")


def benchmark(a2a, group, args, tokens, name):
    """Time `tokens` tokens per rank; rank 0 prints and returns a row of figures."""
    L = a2a.L
    indices, weights = ref.routing("random", args.seed, group.rank, L.world, tokens,
                                   L.experts, L.topk)
    xp, mem = a2a.xp, a2a.mem
    x, indices, weights = (xp.asarray(a) for a in (
        ref.tokens(args.seed, group.rank, tokens, L.hidden), indices, weights))
    expert_out = xp.zeros((L.world * L.per_peer, L.hidden), xp.float32)
    if group.rank == 0:
        print(f"benchmark {name}: {tokens} tokens per rank, hidden {L.hidden}, top-{L.topk} of "
              f"{L.experts} experts, {a2a.wire.dtype} dispatch ({L.row} B per row) / "
              f"bf16 combine ({L.out_row} B); {args.iters} iterations after {args.warmup}",
              flush=True)
    times = []
    mem.ready()
    group.barrier()  # once: from then on each round's combine-recv, which waits for every
    # peer, lines the ranks up for the next, as layer follows layer in a model (a host
    # barrier per round let them start up to 90 us apart on 2 x H200: rank 0 hosts the
    # rendezvous; the receive halves counted that as latency)
    for i in range(args.warmup + args.iters):
        t0 = mem.mark()  # the machine's clock, or CUDA events on the rank's stream
        a2a.dispatch_send(x, indices)
        t1 = mem.mark()
        received, scales, counts = a2a.dispatch_recv()
        t2 = mem.mark()
        a2a.combine_send(expert_out[:len(received)])
        t3 = mem.mark()
        a2a.combine_recv(weights)
        t4 = mem.mark()
        if i >= args.warmup:
            t = [mem.seconds(a, b) for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]
            times.append((t[0], t[1], t[0] + t[1], t[2], t[3], t[2] + t[3]))
    mine = struct.pack(f"<{len(PHASES)}d", *np.median(np.array(times), axis=0))
    every = np.array([struct.unpack(f"<{len(PHASES)}d", b) for b in group.allgather(mine)])
    if group.rank:
        return None
    if a2a.proxy:
        print(f"proxy of rank 0: {a2a.proxy.p.posted} WRITEs, -FI_EAGAIN {a2a.proxy.p.eagain} "
              "times")
    print("latency, the median of each rank, then across ranks:")
    rows = tokens * L.topk
    sizes = {"dispatch": rows * L.row, "combine": rows * L.out_row}
    figures = {"implementation": name, "tokens": tokens, "rows": rows,
               "dispatch_bytes": sizes["dispatch"], "combine_bytes": sizes["combine"]}
    for phase, col in zip(PHASES, every.T):
        p50, worst = float(np.median(col)), float(col.max())
        key = phase.replace(" ", "_")
        figures[f"{key}_p50_us"], figures[f"{key}_max_us"] = 1e6 * p50, 1e6 * worst
        line = f"  {phase:<14} p50 {1e6 * p50:9.1f} us   max {1e6 * worst:9.1f} us"
        if phase in sizes:
            figures[f"{key}_gb_per_s"] = sizes[phase] / p50 / 1e9
            line += (f"   {sizes[phase] / p50 / 1e9:.3f} GB/s ({rows} rows x "
                     f"{sizes[phase] // max(rows, 1)} B / p50)")
        print(line, flush=True)
    return figures


def record(path, args, group, provider, rows):
    """The benchmark as JSON: what ran, where, and a row per (implementation, tokens)."""
    data = {"chapter": "16_moe", "args": sys.argv[1:], "device": args.device,
            "drive": args.drive, "counts": args.counts, "world": group.world,
            "ranks_per_node": group.ranks_per_node,
            "provider": provider, "libfabric": "%d.%d" % fi.version(),
            "machine": bench.machine(0 if args.device == "cuda" else None),
            "git": bench.git_sha(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "shape": {"hidden": args.hidden, "experts": args.experts, "topk": args.topk,
                      "dispatch": args.dispatch_dtype, "combine": args.combine_dtype,
                      "private_tokens": args.private_tokens},
            "runs": rows}
    return bench.write_json(path, data)


def token_list(text):
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes numbers like 1,8,128, got '{text}'") \
            from None


def main():
    p = cli.parser(__doc__)
    p.add_argument("--device", choices=list(DEVICES), default="cpu",
                   help="cpu: numpy and host memory (default); cuda: GPU memory, cupy and "
                   "16_moe.cu (see --drive)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per rank, at most")
    p.add_argument("--tokens", type=token_list, help="tokens per rank in the benchmark, "
                   "one run each, e.g. 1,8,128 (default: the maximum)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dispatch-dtype", choices=["fp8", "bf16"], default="fp8",
                   help="the benchmark's (the checks run both)")
    p.add_argument("--combine-dtype", choices=["bf16"], default="bf16",
                   help="what expert outputs travel back as (bf16, summed in float32)")
    p.add_argument("--private-tokens", type=int, default=8,
                   help="tokens per sender that travel with the counts (default 8)")
    p.add_argument("--drive", choices=["gpu", "host"], help="--device cuda: gpu (the "
                   "default), the kernels push over NVLink and feed the proxy "
                   "(common/moe/nvlink.py); host, this file's protocol driven from Python, "
                   "as --device cpu runs it")
    p.add_argument("--counts", choices=["host", "device"], default="host",
                   help="--drive gpu: where dispatch-recv leaves the per-expert counts: host "
                   "(it waits for the GPU; the default) or device (it returns at once, as "
                   "the published kernels do; see common/moe/nvlink.py)")
    p.add_argument("--baseline", choices=["nccl"], help="also check and time the NCCL "
                   "all-to-all (--device cuda)")
    p.add_argument("--check", default="all", help="cases to check: all, none, or some of "
                   + ", ".join(ref.CASES))
    p.add_argument("--nics", type=int, help="NICs per rank for its proxy: the first that "
                   "many of its GPU's (default: all, chapter 08's topology); where no NIC has "
                   "a PCI address, that many virtual NICs (default 1)")
    p.add_argument("--iters", type=int, default=20, help="benchmark iterations (0: none)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, help="inputs of the checks (default: fresh ones)")
    p.add_argument("--world", type=int, help="expect this many ranks (refuse otherwise)")
    p.add_argument("--json", nargs="?", const="auto", help="rank 0 writes the benchmark "
                   "as JSON to this file (default results/runs/16_moe-...json)")
    args = p.parse_args()
    place = launch.place_from_environment()
    args.tokens = [args.max_tokens] if args.tokens is None else args.tokens
    args.seed = int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed
    cases = list(ref.CASES) if args.check == "all" else [] if args.check == "none" \
        else args.check.split(",")
    if set(cases) - set(ref.CASES):
        raise cli.UsageError(f"--check: unknown case(s) {', '.join(set(cases) - set(ref.CASES))}"
                             f" (cases: {', '.join(ref.CASES)})")
    if args.world is not None and args.world != place.world:
        raise cli.UsageError(f"--world {args.world}, but this job has {place.world} "
                             f"rank{'s' if place.world > 1 else ''} ({place.source})")
    for tokens in args.tokens:
        if not 0 <= tokens <= args.max_tokens:
            raise cli.UsageError(f"--tokens {tokens}: more than --max-tokens "
                                 f"{args.max_tokens} (or negative)")
    if args.nics is not None and not 1 <= args.nics <= 64:
        raise cli.UsageError(f"--nics must be 1..64, not {args.nics}")
    if args.drive == "gpu" and args.device != "cuda":
        raise cli.UsageError("--drive gpu needs --device cuda")
    args.drive = args.drive or ("gpu" if args.device == "cuda" else "host")
    if args.counts == "device" and args.drive != "gpu":
        raise cli.UsageError("--counts device needs --drive gpu (and --device cuda)")
    if args.baseline and args.device != "cuda":
        raise cli.UsageError("--baseline nccl needs --device cuda")
    if args.provider:  # only the proxies use it (peers on other nodes); a wrong one is said anyway
        try:
            fi.pick(args.provider, lib.FI_MSG | lib.FI_RMA)
        except ValueError as e:
            raise cli.UsageError(str(e)) from None
    try:
        check_shape(place.world, args.max_tokens, args.experts, args.topk, args.hidden,
                    args.dispatch_dtype, args.private_tokens, args.combine_dtype)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    if "empty-expert" in cases and args.topk >= args.experts:
        raise cli.UsageError("the empty-expert check needs --topk < --experts")
    args.dtypes = ["fp8", "bf16"]

    with launch.Group(place, args.timeout) as group:
        def ours(own, dtype, private):
            if args.drive == "gpu":
                def proxy(own, mem, stamps, largest):
                    return Proxy(own, group, mem, stamps, args.provider, args.timeout, largest,
                                 kernels_wait=True, nics=args.nics)
                return NvlinkAllToAll(own, group, args.max_tokens, args.experts, args.topk,
                                      args.hidden, dtype, private, args.timeout, KERNELS,
                                      args.combine_dtype, proxy, args.counts)
            return AllToAll(own, group, args.max_tokens, args.experts, args.topk, args.hidden,
                            dtype, private, args.provider, args.timeout, args.device,
                            args.combine_dtype, args.nics)

        def nccl(own, dtype, private):
            return NcclAllToAll(own, group, args.max_tokens, args.experts, args.topk,
                                args.hidden, dtype, KERNELS, args.combine_dtype)
        builds = {"ours": ours, **({"nccl": nccl} if args.baseline else {})}
        if group.rank == 0:
            where = f"{group.nodes} emulated nodes of {group.ranks_per_node}" \
                if group.nodes > 1 else "one node"
            how = {"cpu": "numpy, host memory; same node: shared memory",
                   "cuda": "GPU memory; same node: CUDA IPC, "
                   + ("kernels push over NVLink" if args.drive == "gpu"
                      else "copies driven by the host")
                   + ("; dispatch-recv leaves the counts on the GPU"
                      if args.counts == "device" else "")}[args.device]
            print(f"{group.world} ranks ({place.source}), {where}; device {args.device}: {how}"
                  + ("; other nodes: libfabric WRITEs through the proxy" if group.nodes > 1
                     else ""), flush=True)
        if cases:
            for name, build in builds.items():
                run_checks(build, group, args, cases, "" if name == "ours" else name + " ")
        rows, provider = [], None
        for name, build in builds.items() if args.iters else ():
            with fi.Closer() as own:
                a2a = build(own, args.dispatch_dtype, args.private_tokens)
                if a2a.proxy:
                    provider = a2a.proxy.provider
                    if group.rank == 0:
                        print(f"provider: {provider}; proxy of rank 0: {a2a.proxy.nics}",
                              flush=True)
                        if provider == "efa":
                            print(fi.SHM_OFF, flush=True)
                for tokens in args.tokens:
                    rows.append(benchmark(a2a, group, args, tokens, name))
                group.barrier()
        if args.json and group.rank == 0 and rows:
            path = bench.run_path(args.json, "16_moe", args.device, f"{group.world}ranks",
                                  f"{group.nodes}nodes")
            print(f"result: {record(path, args, group, provider, rows)}", flush=True)


if __name__ == "__main__":
    cli.run(main)

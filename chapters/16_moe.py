"""Chapter 16 - moe: the expert-parallel all-to-all (dispatch / combine) across nodes.

What you will learn: how a MoE layer's tokens travel, and the protocol Perplexity built
on libfabric for EFA. dispatch sends every token to the ranks hosting its `topk`
experts, which receive them expert by expert, contiguous, ready for a grouped GEMM;
combine sends each expert's output back to the token's rank, which sums them, weighted
by the router; each is split into a send and a receive half. A sender first ships its
per-expert counts with its first tokens into a small slot each receiver keeps for it
(COUNTS); once every rank has every count, the rest go with one WRITE per peer
(OVERFLOW). Node peers are written through shared memory, other nodes by libfabric
WRITEs with immediate data, posted by a host proxy thread in C (common/moe/proxy.c).
The cell "The protocol" below says it in full.

New since chapter 07 (08's topology aside): ranks and a rendezvous (common/launch/,
scripts/launch.py, or torchrun / Slurm variables); fp8 e4m3 with block scales and bf16
(common/moe/reference.py, the reference every run is checked against; checks and
benchmark in common/moe/harness.py); the proxy; --device cpu (the default), where numpy
stands in for the kernels and host memory for GPU memory. Chapter 17 hands it to the GPU.

    .venv/bin/python scripts/launch.py -n 4 --ranks-per-node 2 chapters/16_moe.py -p shm
    .venv/bin/python scripts/launch.py -n 4 --ranks-per-node 2 chapters/16_moe.py -p tcp --nics 2
    .venv/bin/python scripts/launch.py -n 8 --ranks-per-node 4 chapters/16_moe.py -p tcp --max-tokens 16 --hidden 256 --experts 32 --topk 4 --iters 0   # checks only
    .venv/bin/python scripts/launch.py -n 4 chapters/16_moe.py                       # one node
    .venv/bin/python scripts/launch.py -n 2 chapters/16_moe.py --check none --tokens 1,8,32,128 --json
    .venv/bin/python scripts/launch.py -n 2 --ranks-per-node 1 --gpus 0,1 chapters/16_moe.py --device cuda -p shm   # GPU memory, cupy, still host-driven
    torchrun --nproc-per-node 8 chapters/16_moe.py ...                     # a cluster

Transcript (2-core VM, shm and tcp) and figures: results/16_moe/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## The protocol
# Each rank holds some tokens, each routed to `topk` of `experts` experts, and hosts
# experts / world of them. dispatch sends every token to the ranks hosting its experts,
# which receive them expert by expert, contiguous, ready for a grouped GEMM; combine sends
# each expert's output back to the token's rank, which adds them up, weighted by the
# router. Each is split into a send and a receive half, so that other work (shared
# experts) can run in between.
#
# A receiver cannot know where to put a sender's tokens before it knows how many come from
# everyone. So each sender first ships its per-expert counts, and with them its first
# tokens, into a small private slot that each receiver keeps per sender (COUNTS). Once
# every rank has every count, each knows all offsets, and the rest go with one WRITE per
# peer into one region (OVERFLOW). combine needs no counts (the offsets are known by then):
# one WRITE per peer (COMBINE), summed on the receiver; its signal from every peer is also
# the barrier that keeps the next dispatch from overwriting a slot before it was read.
#
# Peers on the same (emulated) node are written directly, through shared memory; peers on
# other nodes through libfabric WRITEs with immediate data, posted by a host proxy thread in
# C (common/moe/proxy.c, GIL released) that this file feeds through a ring in host memory
# (common/moe/proxy.py opens its NICs, as common/engine/nics.py chooses them: its GPU's by
# chapter 08's topology, or --nics N virtual ones). Data that arrived is one thing to wait
# for, whichever way it came: a stamp in an arrival table, written by the node peer, or by
# the proxy from an immediate.

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
import common  # first: a Ctrl-C during the imports below is one line (common/bounds.py)
import os
import time

import numpy as np

from common import cli, launch
from common.moe._native import ffi, lib as native
from common.gpu import rounding
from common.gpu.layout import aligned
from common.moe import harness
from common.moe.bookkeeping import Shape, Stages, Wire, check_shape, check_tokens, receive_plan, \
    send_plan, weighted_sum
from common.moe.memory import DEVICES, Region
from common.moe.proxy import Proxy

COUNTS, OVERFLOW, COMBINE = range(3)  # what a stamp says arrived (the immediate's kind)
KINDS = 3
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts", "launch.py")


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
        self.mem = mem = DEVICES[device](own, group, L.size)
        self.xp, self.wire = mem.xp, Wire(dispatch_dtype, hidden, mem)
        # the arrival table, [kind][source]: host memory, stamped by node peers and our proxy
        size = 4 * KINDS * group.world
        table = Region(group.job, f"{group.rank}-stamps", size)
        own.callback(table.unlink)
        largest = max(L.slot, L.per_peer * L.row, max_tokens * topk * L.out_row)
        self.proxy = (Proxy(own, group, mem, table.ptr, KINDS, provider, timeout, largest,
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
        out[self.gather] = rounding.to_bf16(expert_out)  # back in each sender's order
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


def main():
    p = cli.parser(__doc__)
    p.add_argument("--device", choices=list(DEVICES), default="cpu",
                   help="cpu: numpy and host memory (default); cuda: GPU memory and cupy, "
                   "the host still driving (chapter 17 hands it to the GPU)")
    harness.add_arguments(p)
    args = p.parse_args()
    place = launch.place_from_environment()
    harness.check_arguments(args, place)

    with launch.Group(place, args.timeout) as group:
        def ours(own, dtype, private):
            return AllToAll(own, group, args.max_tokens, args.experts, args.topk, args.hidden,
                            dtype, private, args.provider, args.timeout, args.device,
                            args.combine_dtype, args.nics)
        how = {"cpu": "numpy, host memory; same node: shared memory",
               "cuda": "GPU memory, cupy; same node: CUDA IPC copies"}[args.device]
        harness.say_world(group, place.source, f"device {args.device}: {how}",
                          "libfabric WRITEs through the proxy")
        if group.rank == 0 and group.nodes == 1:
            again = cli.command("-n", "4", "--ranks-per-node", "2", cli.shown(__file__),
                                program=LAUNCHER)
            print(f"one node: libfabric carries no token; across two: {again}", flush=True)
        rows, provider = harness.run(group, args, {"ours": ours})
        harness.write(group, args, "16_moe", rows, provider)


if __name__ == "__main__":
    cli.run(main)

"""Chapter 16's all-to-all driven by the GPU: the kernels of chapters/16_moe.cu push every
row over NVLink into the node peers' memory (mapped through CUDA IPC) and tell them with a
flag; rows for other nodes go into an outbox in our own region, laid out as they will
land, and the kernels queue the WRITEs in the proxy's ring (host memory they write), whose
immediates the peers' proxies turn into stamps their GPUs read. No host thread copies,
stamps or polls in between.

The protocol is chapter 16's: a sender's counts and first rows go into its private slot on
each receiver, the rest into one region. Room for every sender's largest stream costs
little next to a GPU's memory, so each sender owns a stripe of that region and needs
nobody else's counts to know where to write: it never waits in dispatch-send. A flag (node
peers) or a stamp (other nodes) holds the round a peer last finished; the receive halves
wait for every peer's, on the GPU. combine-recv waiting for every peer's outputs is also
the barrier: a peer's next dispatch comes after its combine-recv, so it cannot overwrite a
slot that was not read yet. The host launches kernels, and waits only where the caller
needs the answer: the counts at the end of dispatch-recv (unless the caller leaves them on
the GPU), the sums at the end of combine.

Across nodes it relies on what EFA guarantees: once the proxy sees a WRITE's immediate,
its bytes are in our GPU memory. shm, standing in for EFA on one host, copies with CUDA
calls that may still run then; the proxy settles them before it stamps (chapters/16_moe.c).
"""
import os
import time

import numpy as np

from common.moe.bookkeeping import (Shape, Stages, Wire, aligned, check_shape, check_tokens,
                                    index_error)
from common.moe.kernel_call import KernelCall
from common.moe.memory import CudaMemory
from common.moe.reference import FP8_BLOCK

THREADS = 256
BLOCKS = 4096  # at most, for kernels that stride over rows the host may not know the count of


class NodeLayout(Shape):
    """A rank's region, the same offsets on every rank (see chapters/16_moe.cu). With
    peers on other nodes, an outbox too: what goes to them, laid out as it will land."""

    def __init__(self, world, experts, max_tokens, topk, hidden, dtype, private, far=False):
        super().__init__(world, experts, max_tokens, topk, hidden, dtype)
        self.private = private
        self.header = aligned(4 * experts)  # a sender's counts, one int32 per expert
        self.slot = aligned(self.header + private * self.row)
        self.lay_out([("flags", 4 * 2 * world), ("slots", world * self.slot),
                      ("overflow", world * self.per_peer * self.row),
                      ("combine_in", world * self.per_peer * self.out_row),
                      ("out_slots", far * world * self.slot),
                      ("out_stripes", far * world * self.per_peer * self.row),
                      ("combine_out", far * world * self.per_peer * self.out_row),
                      ("signal_in", far * 8 * world), ("signal_out", far * 8)])


class NvlinkAllToAll(Stages):
    """dispatch and combine driven by the GPUs: node peers through NVLink, other nodes
    through `proxy` (a factory: own, mem, arrival table address, largest WRITE -> the
    chapter's Proxy), which the kernels feed through its ring.

    counts: where dispatch_recv leaves the per-expert counts. "host": it waits for the GPU
    and returns the rows received, counts in host memory. "device": it returns at once,
    as the published kernels do: the whole receive buffers (the first counts.sum() rows
    hold the tokens), counts in GPU memory, so the host can queue the experts' work behind
    it; combine_send then takes an output for every row of the buffer, and combine_recv
    raises what the GPU found wrong in the dispatch (a refused batch, a late peer). Until
    combine_recv, stage inputs and read results before and after, not in between: across
    nodes on shm, whose copies are CUDA calls from the proxy's thread, a host blocked in a
    CUDA call that waits for our stream (a copy to or from pageable memory) held those
    copies up for good on 2 x H200, the peers' counts never came."""

    def __init__(self, own, group, max_tokens, experts, topk, hidden, dispatch_dtype="fp8",
                 private_tokens=8, timeout=30.0, kernels=None, combine_dtype="bf16",
                 proxy=None, counts="host"):
        check_shape(group.world, max_tokens, experts, topk, hidden, dispatch_dtype,
                    private_tokens, combine_dtype)
        if counts not in ("host", "device"):
            raise ValueError(f"counts go to the host or the device, not {counts!r}")
        self.counts_on = counts
        far = group.nodes > 1
        if far and proxy is None:
            raise ValueError("peers on other nodes need a proxy")
        self.group, self.timeout = group, timeout
        self.L = L = NodeLayout(group.world, experts, max_tokens, topk, hidden,
                                dispatch_dtype, private_tokens, far)
        # Across nodes, shm's copies into our memory run from the proxy's thread on CUDA's
        # legacy stream, which would wait for our spinning kernels on a blocking stream.
        self.mem = mem = CudaMemory(own, group, L.size, kernels, blocking=not far)
        cp = self.xp = mem.xp
        self.wire = Wire(dispatch_dtype, hidden, mem)
        node = range(group.node * group.ranks_per_node, (group.node + 1) * group.ranks_per_node)
        self.proxy = None
        ring = head = ring_size = table = 0  # one node: the kernels never look at them
        if far:
            # the arrival table: only our proxy and our GPU use it (no node peer stamps it)
            self.stamps = mem.host_shared(4 * 3 * group.world)
            table = self.stamps.ctypes.data
            largest = max(L.slot, L.per_peer * L.row, L.per_peer * L.out_row)
            self.proxy = p = proxy(own, mem, table, largest)
            if 3 * group.world > p.p.ring_size:
                raise ValueError(f"{group.world} ranks queue more WRITEs a round than the "
                                 f"proxy's ring holds ({p.p.ring_size})")
            head = p.shared.ctypes.data  # the ring's head, then the ring (pinned: mapped)
            ring, ring_size = head + 8, p.p.ring_size
        self.far = cp.asarray(np.array(  # as M16_FAR in chapters/16_moe.cu
            [node.start, len(node), L.out_slots, L.out_stripes, L.combine_out, L.signal_in,
             L.signal_out, ring, head, ring_size, table], np.int64))
        handles = group.allgather(mem.handle())
        self.peers = cp.asarray(np.array(
            [mem.mine if r == group.rank else mem.open(own, r, handles[r]) if r in node else 0
             for r in range(group.world)], np.uint64))
        entries, rows = max_tokens * topk, group.world * L.per_peer
        self.counts = cp.zeros(experts, cp.int32)
        self.gate = cp.zeros(2, cp.uint32)  # combine_sum: block 0 waits, tells the rest
        self.position = cp.zeros(entries, cp.int32)  # of a selection among its expert's
        self.stream_pos = cp.zeros(entries, cp.int32)  # ...and in our stream to its rank
        self.plan = cp.zeros(3 * experts, cp.int32)
        self.state = cp.zeros(2, cp.int32)  # see m16_dispatch_plan
        # host memory the kernels write (mapped: one address for both): the host reads
        # the counts and the verdicts once the stream is done, without a copy
        self.report = mem.host_shared(4 * (L.local + 4)).view(np.int32)
        self.report_at = np.uintp(self.report.ctypes.data)
        self.row_source = cp.zeros(rows, cp.int32)
        self.row_stream = cp.zeros(rows, cp.int32)
        self.rows = cp.zeros((max_tokens, L.row), cp.uint8)  # our tokens on the wire
        # what dispatch_recv hands out (valid until the next one): the tokens, and fp8's
        # scales, which the gather writes apart
        self.split = hidden if dispatch_dtype == "fp8" else L.row
        self.tokens = cp.zeros((rows, self.split), cp.uint8)
        self.scales = cp.zeros((rows, L.row - self.split), cp.uint8)
        self.received = cp.zeros(L.local, cp.int32)  # rows per local expert, on the GPU
        self.buffers = (self.tokens, self.scales.view(cp.float32), self.received) \
            if dispatch_dtype == "fp8" else (self.tokens.view(cp.uint16), None, self.received)
        self.done = cp.zeros(2, cp.uint32)  # the last-block counters of the two pushes
        self.timeout_ns = int(timeout * 1e9)
        self._bind_kernels()
        mem.ready()  # zeroed flags everywhere before anyone pushes
        group.barrier()
        self.round = 0

    def _bind_kernels(self):
        """Each kernel of chapters/16_moe.cu with its arguments, in the order of its
        signature: what never changes is set here, None is set by each launch."""
        L, g, mem = self.L, self.group, self.mem

        def kernel(name, threads=THREADS, shared=0, **arguments):
            return KernelCall(mem.module.get_function("m16_" + name), mem.stream, threads,
                              shared, **arguments)
        self.route = kernel("route", indices=None, index_bytes=None, entries=None, topk=L.topk,
                            experts=L.experts, counts=self.counts, position=self.position,
                            error=self.state, x=None, rows=self.rows, hidden=L.hidden,
                            row_bytes=L.row, tokens=None)
        self.push = kernel(
            "dispatch_push", rows=None, indices=None, index_bytes=None, position=self.position,
            counts=self.counts, entries=None, topk=L.topk, experts=L.experts, local=L.local,
            row_bytes=L.row, private_rows=L.private, per_peer=L.per_peer, peers=self.peers,
            slots=L.slots, slot_bytes=L.slot, header_bytes=L.header, overflow=L.overflow,
            flags=L.flags, rank=g.rank, world=L.world, round=None,
            stream_pos=self.stream_pos, error=self.state, done=self.done[0:], far=self.far)
        self.plan_kernel = kernel(
            "dispatch_plan", 1024, 3 * 4 * L.experts, region=mem.data, flags=L.flags,
            slots=L.slots, slot_bytes=L.slot, rank=g.rank, world=L.world, local=L.local,
            round=None, timeout_ns=self.timeout_ns, plan=self.plan, state=self.state,
            report=self.report_at, received=self.received, far=self.far)
        self.gather = kernel(
            "dispatch_gather", region=mem.data, plan=self.plan, state=self.state,
            local=L.local, world=L.world, row_bytes=L.row, split=self.split,
            private_rows=L.private, per_peer=L.per_peer, slots=L.slots, slot_bytes=L.slot,
            header_bytes=L.header, overflow=L.overflow, out=self.tokens, tail=self.scales,
            row_source=self.row_source, row_stream=self.row_stream)
        self.combine_push = kernel(
            "combine_push", expert_out=None, row_source=self.row_source,
            row_stream=self.row_stream, state=self.state, hidden=L.hidden, peers=self.peers,
            combine_in=L.combine_in, per_peer=L.per_peer, flags=L.flags, rank=g.rank,
            world=L.world, round=None, done=self.done[1:], plan=self.plan, local=L.local,
            far=self.far)
        self.combine_sum = kernel(  # shared memory: each token's topk row offsets and weights
            "combine_sum", THREADS, 12 * L.topk, region=mem.data, flags=L.flags,
            combine_in=L.combine_in, indices=None, index_bytes=None,
            stream_pos=self.stream_pos, weights=None, tokens=None, topk=L.topk,
            hidden=L.hidden, local=L.local, per_peer=L.per_peer, world=L.world, round=None,
            timeout_ns=self.timeout_ns, out=None, report=self.report_at, far=self.far,
            gate=self.gate)

    def _finish(self, what):
        """Wait for this rank's GPU work (watching the other ranks meanwhile), then for what
        the kernels reported: the counts and who, if anyone, was late."""
        stream, deadline = self.mem.stream, time.monotonic() + self.timeout + 10
        while not stream.done:
            if self.proxy:
                self.proxy.check(self.group, None, what)
            else:
                self.group.check()
            if time.monotonic() > deadline:  # the kernels give up on their own before this
                raise TimeoutError(f"the GPU did not finish {what} within "
                                   f"{self.timeout + 10:g} s")
            os.sched_yield()
        report = self.report.copy()
        local = self.L.local
        if report[local + 3]:  # nothing was sent: the next batch may go
            self.stage = "idle"
            raise ValueError(index_error(int(report[local + 3]), self.L.experts))
        for late, kind in ((report[local + 1], "counts"), (report[local + 2],
                                                            "combine outputs")):
            if late:
                raise TimeoutError(f"no {kind} from rank {late - 1} within "
                                   f"{self.timeout:g} s")
        return report

    def dispatch_send(self, x, indices):
        """Quantise, number each selection, push every row to its expert's rank. The
        indices' values are checked on the GPU: a bad batch is refused (nothing sent) and
        said by dispatch_recv."""
        L, xp = self.L, self.xp
        indices = check_tokens(xp, x, indices, L, values=False, keep=(np.int32, np.int64))
        self._stage("idle", "dispatch sent")
        self.round += 1
        self.indices, entries = indices, indices.size
        if L.dtype == "fp8":  # the route kernel quantises them into self.rows
            x = xp.ascontiguousarray(x, dtype=xp.float32)
            self.sending, rows, quantize = x, self.rows, len(x)  # kept: read after we return
        else:
            rows = self.sending = self.wire.encode(x)
            quantize = 0
        groups = quantize * L.hidden // FP8_BLOCK  # two a block, after the experts' blocks
        size = indices.itemsize
        self.route(L.experts + (groups + 1) // 2, indices=indices, index_bytes=size,
                   entries=entries, x=x if quantize else 0, tokens=quantize)
        self.push(entries + L.world, rows=rows, indices=indices, index_bytes=size,
                  entries=entries, round=self.round)

    def dispatch_recv(self):
        """Wait for every sender, lay the rows out expert-major. Returns (tokens, scales,
        counts per local expert); scales is None for bf16. tokens and scales live in this
        object's buffers: valid until the next dispatch_recv. With counts on the device,
        the GPU does the waiting (see the class)."""
        L = self.L
        self._stage("dispatch sent", "dispatched")
        self.plan_kernel(1, round=self.round)
        self.gather(min(len(self.tokens), BLOCKS))
        if self.counts_on == "device":
            return self.buffers
        report = self._finish("dispatch")
        self.total = n = int(report[L.local])
        if L.dtype == "fp8":
            return self.tokens[:n], self.scales[:n].view(self.xp.float32), \
                report[:L.local].astype(np.int64)
        return self.tokens[:n].view(self.xp.uint16), None, report[:L.local].astype(np.int64)

    def combine_send(self, expert_out):
        """Send each expert output (float32, expert-major as dispatch_recv gave the
        tokens) back as bf16, straight into its source's memory."""
        L, xp = self.L, self.xp
        rows = self.total if self.counts_on == "host" else len(self.tokens)
        if self.stage == "dispatched" and expert_out.shape != (rows, L.hidden):
            raise ValueError(f"expert outputs must be ({rows}, {L.hidden}), "
                             f"got {expert_out.shape}")
        self._stage("dispatched", "combine sent")
        self.expert_out = xp.ascontiguousarray(expert_out, dtype=xp.float32)
        self.combine_push(min(rows, BLOCKS), expert_out=self.expert_out, round=self.round)

    def combine_recv(self, weights):
        """Wait for every peer's outputs (the barrier before the next dispatch), then the
        weighted sum. weights: (n, topk); returns (n, hidden) float32."""
        L, xp = self.L, self.xp
        n = len(self.indices) if self.stage == "combine sent" else None
        if n is not None and weights.shape != (n, L.topk):
            raise ValueError(f"weights must be ({n}, {L.topk}), got {weights.shape}")
        self._stage("combine sent", "idle")
        weights = xp.ascontiguousarray(weights, dtype=xp.float32)
        out = xp.empty((n, L.hidden), xp.float32)
        self.combine_sum(n, indices=self.indices, index_bytes=self.indices.itemsize,
                         weights=weights, tokens=n, round=self.round, out=out)
        self._finish("combine")
        return out

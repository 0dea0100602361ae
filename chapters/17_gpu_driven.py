"""Chapter 17 - gpu_driven: the GPU drives chapter 16's all-to-all, and a serving engine calls it.

What you will learn: how to take the host out of the loop. In chapter 16 the host packs,
copies, stamps and waits between every step; here kernels do it all: route (count, number
and quantise each selection), push (each row straight into its receiver's memory over
NVLink, through CUDA IPC, then a flag), plan and gather expert-major on the receiver;
combine pushes back and sums. Rows for other nodes go into an outbox laid out as they will
land; the kernels queue the WRITEs in the proxy's ring themselves and poll the stamps the
peer's proxy leaves. The host only launches. With --counts device nothing waits on the
host, so one MoE layer can be captured in a CUDA graph and replayed, torch tensors in and
out on the caller's stream (the cell "A serving engine calls it" below).

New since chapter 16: the kernels (chapters/17_gpu_driven.cu); each sender owns a stripe
of the receiver's region, so it needs nobody's counts before it sends the rest; --counts
device, --graph, --baseline nccl; AllToAll, the layer a serving engine calls (its arrays
and stream taken as common/moe/serving.py says; the graph's check, common/moe/graphs.py).

    .venv/bin/python scripts/launch.py -n 1 --gpus 0 chapters/17_gpu_driven.py
    .venv/bin/python scripts/launch.py -n 2 --gpus 0 chapters/17_gpu_driven.py --counts device --graph
    .venv/bin/python scripts/launch.py -n 2 --ranks-per-node 1 --gpus 0,1 chapters/17_gpu_driven.py -p shm
    .venv/bin/python scripts/launch.py -n 2 --gpus 0,1 chapters/17_gpu_driven.py --baseline nccl
    .venv/bin/python scripts/launch.py -n 1 --gpus 0 chapters/17_gpu_driven.py --check none --tokens 1,128 --counts device --graph --iters 200 --json   # decode latency
    torchrun --nproc-per-node 8 chapters/17_gpu_driven.py ...            # a cluster

Transcripts (one H200) and figures (one and 2 x H200): results/17_gpu_driven/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## A serving engine calls it
# The kernels change one thing in chapter 16's protocol: room for every sender's largest
# stream costs little next to a GPU's memory, so each sender owns a stripe of the
# receiver's region and needs nobody's counts before it sends the rest. And it allows what
# a serving engine asks for first: with --counts device, nothing in the four halves waits
# on the host (the per-expert counts stay on the GPU, the round number advances on the
# GPU), so one MoE layer can be captured in a CUDA graph and replayed, and torch tensors go
# in and out without a copy, on the caller's stream:
#
#     a2a = AllToAll(own, group, max_tokens=128, experts=256, topk=8, hidden=7168,
#                    counts="device")                     # takes torch or cupy arrays
#     def moe_layer(x, topk_idx, topk_weights):          # x: (n, 7168) float32 torch
#         a2a.dispatch_send(x, topk_idx)
#         shared = shared_expert(x)                        # overlaps the all-to-all
#         tokens, scales, counts = a2a.dispatch_recv()     # torch tensors, on the GPU
#         a2a.combine_send(grouped_gemm(tokens, scales, counts))
#         return a2a.combine_recv(topk_weights) + shared
#     graph = torch.cuda.CUDAGraph()
#     with torch.cuda.graph(graph):                        # capture once ...
#         y = moe_layer(x, topk_idx, topk_weights)
#     graph.replay()                                       # ... replay each step; a2a.check()

# %% [markdown]
# ## Motivation
#     rank s: route (count, number, quantise) -> push: each row into d's memory
#             (NVLink: a store; another node: the outbox, then a WRITE in the proxy's
#             ring) -> the last block raises s's flag on every d
#     rank d: plan (wait for every flag, lay out expert-major) -> gather -> experts
#             -> combine push (back into s's memory, flag) -> sum (wait, add up)
#     the host: five launches a layer, or one graph replay; no wait unless asked

# %%
import common  # first: a Ctrl-C during the imports below is one line (common/bounds.py)
import os
import time

import numpy as np

from common import cli, launch
import common.fabric as fi
from common.fabric import memory
from common.gpu.kernel_call import KernelCall
from common.gpu.layout import aligned
from common.gpu.rounding import FP8_BLOCK
from common.moe import graphs, harness
from common.moe.bookkeeping import Shape, Stages, Wire, check_shape, check_tokens, index_error
from common.moe.memory import CudaMemory
from common.moe.nccl import NcclAllToAll
from common.moe.proxy import Proxy
from common.moe.serving import Caller

KERNELS = os.path.splitext(os.path.abspath(__file__))[0] + ".cu"  # 17_gpu_driven.cu
KINDS = 3          # what the proxy's stamps say arrived: counts, overflow, combine
THREADS = 256
BLOCKS = 4096  # at most, for kernels that stride over rows the host may not know the count of
PLAN_SHARED = 48 * 1024  # bytes of shared memory the plan kernel may take without opting in
# what the kernels need to reach peers on other nodes, in the order of M17_FAR in the .cu
FAR = ("node_first", "node_size", "out_slots", "out_stripes", "combine_out", "signal_in",
       "signal_out", "ring", "head", "ring_size", "stamps")


# %% [markdown]
# ## Code

# %%
class NodeLayout(Shape):
    """A rank's region, the same offsets on every rank (see chapters/17_gpu_driven.cu).
    With peers on other nodes, an outbox too: what goes to them, laid out as it will land."""

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


def check_sizes(L, free):
    """What the kernels and the GPU can take, refused up front in one line each."""
    if 12 * L.experts > PLAN_SHARED:
        raise ValueError(f"{L.experts} experts: the plan kernel keeps 3 ints per expert in "
                         f"one block's shared memory, {PLAN_SHARED // 12} experts at most")
    if L.size > free:
        raise ValueError(f"the region needs {L.size / 2**30:.2f} GiB of GPU memory (room for "
                         f"every sender's largest stream), {free / 2**30:.2f} GiB are free: "
                         "fewer --max-tokens, a smaller --hidden, or fewer ranks")


class AllToAll(Stages):
    """dispatch and combine driven by the GPUs: node peers through NVLink, other nodes
    through chapter 16's proxy, which the kernels feed through its ring.

    counts: where dispatch_recv leaves the per-expert counts. "host": it waits for the GPU
    and returns the rows received, counts in host memory. "device": nothing waits on the
    host (a CUDA graph may capture the halves): dispatch_recv returns at once with the
    whole receive buffers (the first counts.sum() rows hold the tokens) and the counts in
    GPU memory; combine_send takes an output for every row of them; combine_recv raises
    what the GPU found wrong (a refused batch, a late peer), or, while a graph is being
    captured, check() does after a replay.

    Inputs may be cupy arrays or torch tensors (taken through DLPack, no copy); outputs
    are of the inputs' kind. The halves run on the caller's current stream: cupy's, or
    torch's for torch tensors (our own stream waits for it, and it for ours).

    Until combine_recv, stage inputs and read results before and after, not in between:
    across nodes on shm, whose copies are CUDA calls from the proxy's thread, a host
    blocked in a CUDA call that waits for our stream (a copy to or from pageable memory)
    held those copies up for good on 2 x H200, the peers' counts never came."""

    def __init__(self, own, group, max_tokens, experts, topk, hidden, dispatch_dtype="fp8",
                 private_tokens=8, timeout=30.0, combine_dtype="bf16", counts="host",
                 provider=None, nics=None):
        check_shape(group.world, max_tokens, experts, topk, hidden, dispatch_dtype,
                            private_tokens, combine_dtype)
        if counts not in ("host", "device"):
            raise ValueError(f"counts go to the host or the device, not {counts!r}")
        self.counts_on = counts
        far = group.nodes > 1
        self.group, self.timeout = group, timeout
        self.L = L = NodeLayout(group.world, experts, max_tokens, topk, hidden,
                                dispatch_dtype, private_tokens, far)
        cp = memory.cupy()
        memory.use_gpu(group.gpu if group.gpu is not None
                       else group.rank % cp.cuda.runtime.getDeviceCount())
        check_sizes(L, cp.cuda.runtime.memGetInfo()[0])
        # Across nodes, shm's copies into our memory run from the proxy's thread on CUDA's
        # legacy stream, which would wait for our spinning kernels on a blocking stream.
        self.mem = mem = CudaMemory(own, group, L.size, KERNELS, blocking=not far)
        self.xp = mem.xp
        self.wire = Wire(dispatch_dtype, hidden, mem)
        node = range(group.node * group.ranks_per_node, (group.node + 1) * group.ranks_per_node)
        self.proxy = None
        reach = {"node_first": node.start, "node_size": len(node), "out_slots": L.out_slots,
                 "out_stripes": L.out_stripes, "combine_out": L.combine_out,
                 "signal_in": L.signal_in, "signal_out": L.signal_out,
                 "ring": 0, "head": 0, "ring_size": 0, "stamps": 0}  # one node: never read
        if far:
            # the arrival table: only our proxy and our GPU use it (no node peer stamps it)
            self.stamps = mem.host_shared(4 * KINDS * group.world)
            largest = max(L.slot, L.per_peer * L.row, L.per_peer * L.out_row)
            self.proxy = p = Proxy(own, group, mem, self.stamps.ctypes.data, KINDS, provider,
                                   timeout, largest, kernels_wait=True, nics=nics)
            if KINDS * group.world > p.ring_size:
                raise ValueError(f"{group.world} ranks queue more WRITEs a round than the "
                                 f"proxy's ring holds ({p.ring_size})")
            reach.update(ring=p.ring_at, head=p.head_at, ring_size=p.ring_size,
                         stamps=self.stamps.ctypes.data)  # host memory, mapped for the GPU
        self.far = cp.asarray(np.array([reach[k] for k in FAR], np.int64))
        handles = group.allgather(mem.handle())
        self.peers = cp.asarray(np.array(
            [mem.mine if r == group.rank else mem.open(own, r, handles[r]) if r in node else 0
             for r in range(group.world)], np.uint64))
        self._buffers(cp)
        self.timeout_ns = int(timeout * 1e9)
        self._bind_kernels()
        mem.ready()  # zeroed flags everywhere before anyone pushes
        group.barrier()

    def _buffers(self, cp):
        """What the kernels keep between launches, made once: a graph replays their
        addresses."""
        L = self.L
        entries, rows = L.max_tokens * L.topk, L.world * L.per_peer
        self.round_at = cp.zeros(1, cp.uint32)  # the layer's number, advanced by m17_route
        self.counts = cp.zeros(L.experts, cp.int32)
        self.gate = cp.zeros(2, cp.uint32)  # combine_sum: block 0 waits, tells the rest
        self.position = cp.zeros(entries, cp.int32)  # of a selection among its expert's
        self.stream_pos = cp.zeros(entries, cp.int32)  # ...and in our stream to its rank
        self.plan = cp.zeros(3 * L.experts, cp.int32)
        self.state = cp.zeros(2, cp.int32)  # see m17_dispatch_plan
        # host memory the kernels write (mapped: one address for both): the host reads
        # the counts and the verdicts once the stream is done, without a copy
        self.report = self.mem.host_shared(4 * (L.local + 4)).view(np.int32)
        self.report_at = np.uintp(self.report.ctypes.data)
        self.row_source = cp.zeros(rows, cp.int32)
        self.row_stream = cp.zeros(rows, cp.int32)
        self.rows = cp.zeros((L.max_tokens, L.row), cp.uint8)  # our tokens on the wire
        # what dispatch_recv hands out (valid until the next one): the tokens, and fp8's
        # scales, which the gather writes apart
        self.split = L.hidden if L.dtype == "fp8" else L.row
        self.tokens = cp.zeros((rows, self.split), cp.uint8)
        self.scales = cp.zeros((rows, L.row - self.split), cp.uint8)
        self.received = cp.zeros(L.local, cp.int32)  # rows per local expert, on the GPU
        self.buffers = (self.tokens, self.scales.view(cp.float32), self.received) \
            if L.dtype == "fp8" else (self.tokens.view(cp.uint16), None, self.received)
        self.out = cp.zeros((L.max_tokens, L.hidden), cp.float32)  # combine's, in a graph
        self.done = cp.zeros(2, cp.uint32)  # the last-block counters of the two pushes
        self.caller = Caller(cp, self.mem.stream)  # the serving engine's arrays and stream

    def _bind_kernels(self):
        """Each kernel of chapters/17_gpu_driven.cu with its arguments, in the order of its
        signature: what never changes is set here, None is set by each launch."""
        L, g, mem = self.L, self.group, self.mem

        def kernel(name, threads=THREADS, shared=0, **arguments):
            return KernelCall(mem.module.get_function("m17_" + name), mem.stream, threads,
                              shared, **arguments)
        self.route = kernel("route", indices=None, index_bytes=None, entries=None, topk=L.topk,
                            experts=L.experts, counts=self.counts, position=self.position,
                            error=self.state, x=None, rows=self.rows, hidden=L.hidden,
                            row_bytes=L.row, tokens=None, round_at=self.round_at)
        self.push = kernel(
            "dispatch_push", rows=None, indices=None, index_bytes=None, position=self.position,
            counts=self.counts, entries=None, topk=L.topk, experts=L.experts, local=L.local,
            row_bytes=L.row, private_rows=L.private, per_peer=L.per_peer, peers=self.peers,
            slots=L.slots, slot_bytes=L.slot, header_bytes=L.header, overflow=L.overflow,
            flags=L.flags, rank=g.rank, world=L.world, round_at=self.round_at,
            stream_pos=self.stream_pos, error=self.state, done=self.done[0:], far=self.far)
        self.plan_kernel = kernel(
            "dispatch_plan", 1024, 3 * 4 * L.experts, region=mem.data, flags=L.flags,
            slots=L.slots, slot_bytes=L.slot, rank=g.rank, world=L.world, local=L.local,
            round_at=self.round_at, timeout_ns=self.timeout_ns, plan=self.plan,
            state=self.state, report=self.report_at, received=self.received, far=self.far)
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
            world=L.world, round_at=self.round_at, done=self.done[1:], plan=self.plan,
            local=L.local, far=self.far)
        self.combine_sum = kernel(  # shared memory: each token's topk row offsets and weights
            "combine_sum", THREADS, 12 * L.topk, region=mem.data, flags=L.flags,
            combine_in=L.combine_in, indices=None, index_bytes=None,
            stream_pos=self.stream_pos, weights=None, tokens=None, topk=L.topk,
            hidden=L.hidden, local=L.local, per_peer=L.per_peer, world=L.world,
            round_at=self.round_at, timeout_ns=self.timeout_ns, out=None,
            report=self.report_at, far=self.far, gate=self.gate)

    def capturing(self):
        return self.mem.stream.is_capturing()

    def check(self, what="the layer"):
        """Wait for this rank's GPU work (watching the other ranks meanwhile), then raise
        what the kernels reported: a refused batch, a late peer. Returns the report: rows
        per local expert, then their total."""
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

    # --- the four halves ------------------------------------------------------------
    def dispatch_send(self, x, indices):
        """Quantise, number each selection, push every row to its expert's rank. The
        indices' values are checked on the GPU: a bad batch is refused (nothing sent) and
        said by dispatch_recv (counts on the host) or combine_recv / check()."""
        L, xp = self.L, self.xp
        x, indices = self.caller.take(x, indices)
        indices = check_tokens(xp, x, indices, L, values=False, keep=(np.int32, np.int64))
        if self.counts_on == "host" and self.capturing():
            raise ValueError("a CUDA graph cannot wait on the host: capture with counts on "
                             "the device (--counts device)")
        self._stage("idle", "dispatch sent")
        with self.caller:  # on our stream, after the caller's work, before its next
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
                      entries=entries)

    def dispatch_recv(self):
        """Wait for every sender, lay the rows out expert-major. Returns (tokens, scales,
        counts per local expert); scales is None for bf16. tokens and scales live in this
        object's buffers: valid until the next dispatch_recv. With counts on the device,
        the GPU does the waiting (see the class)."""
        L = self.L
        self._stage("dispatch sent", "dispatched")
        with self.caller:
            self.plan_kernel(1)
            self.gather(min(len(self.tokens), BLOCKS))
        if self.counts_on == "device":
            return tuple(self.caller.give(b) for b in self.buffers)
        report = self.check("dispatch")
        self.total = n = int(report[L.local])
        tokens, scales, _ = self.buffers
        give = self.caller.give
        return give(tokens[:n]), give(None if scales is None else scales[:n]), \
            report[:L.local].astype(np.int64)

    def combine_send(self, expert_out):
        """Send each expert output (float32, expert-major as dispatch_recv gave the
        tokens) back as bf16, straight into its source's memory."""
        L, xp = self.L, self.xp
        (expert_out,) = self.caller.take(expert_out)
        rows = self.total if self.counts_on == "host" else len(self.tokens)
        if self.stage == "dispatched" and expert_out.shape != (rows, L.hidden):
            raise ValueError(f"expert outputs must be ({rows}, {L.hidden}), "
                             f"got {expert_out.shape}")
        self._stage("dispatched", "combine sent")
        with self.caller:
            self.expert_out = xp.ascontiguousarray(expert_out, dtype=xp.float32)
            self.combine_push(min(rows, BLOCKS), expert_out=self.expert_out)

    def combine_recv(self, weights):
        """Wait for every peer's outputs (the barrier before the next dispatch), then the
        weighted sum. weights: (n, topk); returns (n, hidden) float32 (in a graph, this
        object's buffer: each replay writes it)."""
        L, xp = self.L, self.xp
        (weights,) = self.caller.take(weights)
        n = len(self.indices) if self.stage == "combine sent" else None
        if n is not None and weights.shape != (n, L.topk):
            raise ValueError(f"weights must be ({n}, {L.topk}), got {weights.shape}")
        self._stage("combine sent", "idle")
        with self.caller:
            weights = self.weights = xp.ascontiguousarray(weights, dtype=xp.float32)
            captured = self.capturing()
            out = self.out[:n] if captured else xp.empty((n, L.hidden), xp.float32)
            self.combine_sum(n, indices=self.indices, index_bytes=self.indices.itemsize,
                             weights=weights, tokens=n, out=out)
        if not captured:
            self.check("combine")
        return self.caller.give(out)


# %% [markdown]
# ## Run: the checks and the benchmark of chapter 16, then one layer in a CUDA graph
# common/moe/graphs.py captures the four halves once and replays them with new inputs,
# each replay checked against the reference, then times replays of each half.

# %%
def main():
    p = cli.parser(__doc__)
    harness.add_arguments(p)
    p.add_argument("--counts", choices=["host", "device"], default="host",
                   help="where dispatch-recv leaves the per-expert counts: host (it waits "
                   "for the GPU; the default) or device (nothing waits, as the published "
                   "kernels do; needed for --graph)")
    p.add_argument("--graph", action="store_true", help="also capture one layer in a CUDA "
                   "graph: the checks replay it 100 times with new inputs, the benchmark "
                   "times replays (needs --counts device)")
    p.add_argument("--baseline", choices=["nccl"], help="also check and time the NCCL "
                   "all-to-all (a GPU per rank)")
    args = p.parse_args()
    args.device = "cuda"
    place = launch.place_from_environment()
    harness.check_arguments(args, place)
    if args.graph and args.counts != "device":
        raise cli.UsageError("--graph needs --counts device: a graph cannot wait on the host")

    with launch.Group(place, args.timeout) as group:
        def ours(own, dtype, private):
            return AllToAll(own, group, args.max_tokens, args.experts, args.topk, args.hidden,
                            dtype, private, args.timeout, args.combine_dtype, args.counts,
                            args.provider, args.nics)

        def nccl(own, dtype, private):
            return NcclAllToAll(own, group, args.max_tokens, args.experts, args.topk,
                                args.hidden, dtype, args.combine_dtype)
        builds = {"ours": ours, **({"nccl": nccl} if args.baseline else {})}
        harness.say_world(group, place.source, "GPU memory, kernels push over NVLink "
                          "(CUDA IPC)" + ("; counts left on the GPU" if args.counts == "device"
                                          else ""), "the kernels feed the proxy")
        rows, provider = harness.run(group, args, builds)
        if args.graph:  # the benchmark's dtype (bf16's encoding allocates: not in a graph)
            with fi.Closer() as own:
                a2a = ours(own, args.dispatch_dtype, args.private_tokens)
                if args.cases:
                    graphs.check(a2a, group, args, 100)
                for tokens in args.tokens if args.iters else ():
                    rows.append(graphs.benchmark(a2a, group, args, tokens))
                group.barrier()
        harness.write(group, args, "17_gpu_driven", rows, provider,
                      {"counts": args.counts, "graph": args.graph})

if __name__ == "__main__":
    cli.run(main)

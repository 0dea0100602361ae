"""Chapter 19 - weight_update: bf16 training weights into fp8 inference weights, by one-sided WRITEs.

What you will learn: how reinforcement learning moves fresh weights from the training job
into the inference engine in about a second, not a minute. Trainers hold bf16 parameters
in FSDP's dim-0 shards; inference ranks hold fp8 e4m3 weights with a float32 scale per
128 x 128 block, sharded for serving (attention tensor-parallel, q/k/v and gate/up fused,
experts expert-parallel). Both sides send their layouts once; from them every rank
computes the same routing table: which trainer WRITEs which rows of which tensor into
which inference rank, at which offset (fusing is only offsets). An update is then, on
every trainer at once: edge maxima of the blocks trainers share, per layer quantise and
WRITE with an immediate naming the update and the layer, a barrier; an inference rank
knows which layers are complete by those counts. Every weight and scale is checked bit
for bit, beside the naive way (trainer 0 gathers, quantises and sends everything). The
cell "An update, step by step" below has the details.

New since chapter 18: Engine.prepare_list (WRITEs of several lengths, one command made
before the first update and written at each), Engine.signal, Engine.arrived; 128 x 128
blocks and bf16 input in common/gpu/rounding.py's quantize_fp8 and in this chapter's
kernels (19_weight_update.cu, on common/gpu/fp8.cuh, chapter 16's rounding); in
common/weights/, what is not the update: the two sides' layouts (model.py), a trainer's
shards (shards.py), the kernels' numpy twin (ops.py), the check (check.py), the naive
way (naive.py), the report (report.py), and main() with its flags (harness.py).

    .venv/bin/python scripts/launch.py -n 3 chapters/19_weight_update.py -p shm
    .venv/bin/python scripts/launch.py -n 5 chapters/19_weight_update.py -p tcp --trainers 3
    .venv/bin/python scripts/launch.py -n 4 chapters/19_weight_update.py --model tiny --trainers 3 --fail trainer   # a trainer killed mid-update: the layers stale
    .venv/bin/python scripts/launch.py -n 6 --gpus 0 chapters/19_weight_update.py --device cuda --trainers 4 -p shm   # the whole model, every rank on one GPU (101 GiB)

Transcripts (a 2-core VM; the whole model on one H200): results/19_weight_update/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## An update, step by step
# The two sides keep the same model in different shapes: trainers hold bf16 parameters in
# FSDP's dim-0 shards (trainer t: rows [t*ceil(R/T), ...) of every parameter), inference
# ranks hold fp8 e4m3 weights with one float32 scale per 128 x 128 block, sharded for
# serving (attention tensor-parallel, q/k/v fused into one qkv_proj and gate/up into
# gate_up_proj, experts expert-parallel, embeddings by vocabulary rows). Both sides send
# their layouts once; from them every rank computes the same routing table: which trainer
# WRITEs which rows of which tensor into which inference rank, at which offset. Fusing is
# only offsets in that table. Memory is registered once. An update is then, on every
# trainer at once:
#
#   1. edge maxima: a 128-row block straddles two trainers' shards where a shard's edge is
#      not a multiple of 128 rows, so each trainer takes the largest magnitude of its own
#      part of each block and WRITEs those of shared blocks to the trainers that share them
#      (one float per 128 columns: this replaces gathering whole tensors, full_tensor());
#   2. per layer: quantise its own rows with the blocks' scales into staging memory (two
#      halves of --staging: one quantised while the other's WRITEs fly), then one command
#      per inference rank posts the layer's WRITEs (codes, scales, bf16 rows), each with an
#      immediate naming the update and the layer;
#   3. a barrier: every inference rank waits for as many immediates of each layer as the
#      table says it gets, in any order, then meets the trainers.
#
# An inference rank knows which layers are complete by those counts: it serves the new
# weights only after the barrier, and says which layers are stale if a trainer dies
# mid-update. Every weight and scale is then checked, bit for bit, against the plain
# quantisation of the whole tensor (common/gpu/rounding.py), and a second update with a
# third of the parameters changed must change exactly the tensors built from those. The
# same update the naive way runs in the same job: trainer 0 gathers each tensor, quantises
# it and sends all of it to every inference rank.
#
# On the host (--device cpu) numpy quantises, so the seconds are numpy's on your cores, and
# the model is scaled down (said in the output); what shows everywhere is the check.

# %% [markdown]
# ## Motivation
#     trainer t (bf16, FSDP rows)                  inference rank r (fp8, TP / EP shards)
#     rows [t0, t1) of every tensor
#       1. max |x| of its part of each edge block -> the trainers sharing that block
#       2. layer by layer: quantise own rows with the block scales into staging
#          WRITE codes, scales, bf16 rows  ------>   at the table's offsets (fused there)
#          immediate (update, layer)                 expect(that, count from the table)
#       3. barrier  <---------------------------->   barrier, then serve the new weights

# %%
import common  # first: a Ctrl-C during the imports below is one line (common/bounds.py)
import os
import time
from typing import NamedTuple

import numpy as np

from common import cli, launch
from common.gpu import rounding
from common.gpu.layout import aligned
from common.weights import BARRIER, BLOCK, EDGES, LANDED, harness, imm, naive, split
from common.weights.check import Check
from common.weights.model import Param, check_piece, inference_tensors, lay_out, layers_named, \
    parameters, shard_rows
from common.weights.report import Clock, Report
from common.weights.shards import Shards, staging_half

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "19_weight_update.cu")


# %% [markdown]
# ## Code: the routing table, the same on every rank

# %%
class Plan:
    """What every trainer WRITEs where, from the trainers' parameters and each inference
    rank's tensors (its layout, as that rank sent it). Names and shapes are checked
    first: one line for the first mismatch."""

    def __init__(self, params, trainers, layouts, max_write):
        self.params, self.trainers, self.layouts = params, trainers, layouts
        self.max_write = max_write
        names = {p.name: p for p in params}
        self.groups = sorted({p.group for p in params})
        self.rows = [[shard_rows(p.rows, trainers, t) for p in params] for t in range(trainers)]
        self.jobs = [{g: [] for g in self.groups} for _ in range(trainers)]
        for r, tensors in enumerate(layouts):
            for tensor in tensors:
                for piece in tensor.pieces:
                    p = check_piece(names, r, tensor, piece)
                    for t in range(trainers):  # FSDP: every trainer has rows of it
                        t0, t1 = self.rows[t][p.index]
                        lo, hi = max(piece.row0, t0), min(piece.row1, t1)
                        if lo < hi:
                            self.jobs[t][p.group].append(Job(self, t, p, r, tensor, piece, lo, hi))

    def counts(self, r):
        """{group: how many WRITEs inference rank r gets in it, from every trainer}."""
        return {g: sum(len(job.writes) for t in range(self.trainers)
                       for job in self.jobs[t][g] if job.r == r) for g in self.groups}

    def edges(self, t):
        """{trainer u: [(param, block row)]}: the blocks trainer t shares with u (their
        128 rows begin in one shard and end in the other), in the same order on both."""
        out = {}
        for p in self.params:
            t0, t1 = self.rows[t][p.index]
            if not p.fp8 or t0 == t1:
                continue
            for b in sorted({t0 // BLOCK, (t1 - 1) // BLOCK}):
                for u in range(self.trainers):
                    u0, u1 = self.rows[u][p.index]
                    if u != t and max(u0, b * BLOCK) < min(u1, (b + 1) * BLOCK):
                        out.setdefault(u, []).append((p, b))
        return out


class Job:
    """Trainer t's rows [lo, hi) of one piece of an inference rank's tensor: the WRITEs
    of its codes (or bf16 rows) and of the scales of the blocks that begin in its rows."""

    def __init__(self, plan, t, p, r, tensor, piece, lo, hi):
        self.p, self.r, self.lo, self.hi = p, r, lo, hi
        self.col0, self.width = piece.col0, piece.col1 - piece.col0
        to = tensor.offset + (piece.at_row + lo - piece.row0) * tensor.cols * (1 if p.fp8 else 2)
        self.bytes = (hi - lo) * self.width * (1 if p.fp8 else 2)
        self.writes = split("data", to, self.bytes, plan.max_write)
        self.blocks = (-(-lo // BLOCK), -(-hi // BLOCK)) if p.fp8 else (0, 0)
        b0, b1 = self.blocks
        self.scale_bytes = (b1 - b0) * (self.width // BLOCK) * 4
        if self.scale_bytes:
            row = (piece.at_row - piece.row0) // BLOCK + b0
            self.writes += split("scales", tensor.scales + row * (tensor.cols // BLOCK) * 4,
                                 self.scale_bytes, plan.max_write)


# %% [markdown]
# ## Code: a trainer's update

# %%
class Edge(NamedTuple):
    """The block maxima a trainer shares with another trainer u, in floats."""
    amax_index: object  # where they are in our amax (an index array)
    send_at: int        # where ours go in our edge buffer
    inbox_at: int       # where u's arrive in it
    remote_at: int      # where ours land in u's
    count: int          # how many


class Trainer(Shards):
    """Trainer t: its shards (bf16) and the block maxima of its rows (Shards), staging in
    two halves, and the batches of its WRITEs, laid out once from the plan."""

    def __init__(self, eng, plan, t, ops, seed, staging, minimum=0):
        super().__init__(plan.params, plan.rows[t], ops, seed)
        self.eng, self.plan, self.t, xp = eng, plan, t, ops.xp
        self.edges = self._edges()
        self.half = staging_half(plan.jobs[t], t, staging)  # each holds a layer's codes
        self.staging = xp.zeros(max(2 * self.half, minimum), xp.uint8)
        self.batches = self._batches()
        self.regions = {name: eng.register(a) for name, a in (
            ("shard", self.shard), ("staging", self.staging), ("edges", self.edge_buffer))}

    def _edges(self):
        """{trainer u: Edge} for every trainer we share blocks with."""
        mine = self.plan.edges(self.t)
        size = {u: sum(p.cols // BLOCK for p, _ in blocks) for u, blocks in mine.items()}
        sent = sum(size.values())
        out, at = {}, 0
        for u in sorted(mine):
            index = np.concatenate([self.block_index(p, b, np.arange(p.cols // BLOCK))
                                    for p, b in mine[u]])
            theirs = {s: sum(p.cols // BLOCK for p, _ in blocks)  # u's, the same way
                      for s, blocks in self.plan.edges(u).items()}
            there = sum(theirs.values()) + sum(theirs[s] for s in theirs if s < self.t)
            out[u] = Edge(self.ops.xp.asarray(index), at, sent + at, there, size[u])
            at += size[u]
        self.edge_buffer = self.ops.xp.zeros(max(2 * sent, 1), self.ops.xp.float32)
        return out

    def _batches(self):
        """One batch a layer, alternating between the staging's halves; its bf16 rows go
        straight from the shard."""
        out = []
        for g, jobs in self.plan.jobs[self.t].items():
            if jobs:
                out.append(Batch(self, g, len(out) % 2, [j for j in jobs if j.p.fp8],
                                 [j for j in jobs if not j.p.fp8]))
        return out

    def connect(self, peers, remotes, trainers):
        """peers: rank -> Peer; remotes: inference rank -> its weight region; trainers:
        trainer -> its edge buffer. Then each batch's commands are made, once for every
        update (Engine.prepare_list)."""
        self.peers, self.remotes, self.trainer_edges = peers, remotes, trainers
        for b in self.batches:
            b.prepared = [self.eng.prepare_list(peers[self.plan.trainers + c.rank],
                                                self.regions[c.region], c.src, remotes[c.rank],
                                                c.dst, c.lengths) for c in b.commands]

    def update(self, n, fail=False):
        """One update; returns each stage's seconds and what was posted."""
        eng, ops, xp, clock = self.eng, self.ops, self.ops.xp, Clock()
        start = time.perf_counter()
        with clock("edge maxima"):  # 1. our part of every block, the shared ones sent
            self.local_maxima()
            for e in self.edges.values():
                self.edge_buffer[e.send_at:e.send_at + e.count] = self.amax[e.amax_index]
            ops.sync()
            sent = [eng.write(self.peers[u], self.regions["edges"], 4 * e.send_at,
                              self.trainer_edges[u], 4 * e.remote_at, 4 * e.count, imm(n, EDGES))
                    for u, e in self.edges.items()]
        with clock("waiting for other ranks"):
            eng.expect(imm(n, EDGES), len(self.edges))
        with clock("edge maxima"):
            for e in self.edges.values():
                self.amax[e.amax_index] = xp.maximum(
                    self.amax[e.amax_index], self.edge_buffer[e.inbox_at:e.inbox_at + e.count])
            self.scales[...] = rounding.fp8_scales(self.amax)
            for s in sent:
                s.wait()
        flying, writes = [None, None], 0
        for k, batch in enumerate(self.batches):  # 2. quantise a half while the other flies
            with clock("transfer not hidden"):
                self._landed(n, flying[batch.half])
            with clock("quantise"):
                batch.quantise(self)
                ops.sync()
            with clock("RDMA submit"):
                flying[batch.half] = batch, batch.submit(self, n)
            writes += batch.writes
            if fail and k == len(self.batches) // 2:
                harness.fail_here(f"trainer {self.t}", n)
        with clock("transfer not hidden"):
            for last in flying:
                self._landed(n, last)
        with clock("waiting for other ranks"):  # 3. every inference rank has it all
            eng.group(list(self.peers.values())).barrier(imm(n, BARRIER))
        return {"seconds": time.perf_counter() - start, "stages": clock.times,
                "writes": writes, "bytes": sum(b.bytes for b in self.batches)}

    def _landed(self, n, flying):
        """The batch that used a staging half is done with it: its WRITEs completed, and
        every inference rank it wrote to said that the layer is in its memory. (With shm
        and GPU memory a WRITE completes once the target has queued its cudaMemcpy, which
        then reads our staging later: prov/shm/src/smr_progress.c, smr_progress_ipc.)"""
        if flying is None:
            return
        batch, transfers = flying
        for x in transfers:
            x.wait()
        self.eng.expect(imm(n, LANDED | batch.group), len(batch.commands_to))


class Command(NamedTuple):
    """WRITEs to one inference rank, posted as one command (Engine.prepare_list: its
    offsets checked, and by CUDA IPC its table put on the GPU, once for all updates)."""
    region: str          # from the trainer's "staging" or "shard"
    rank: int            # to this inference rank's weights
    src: np.ndarray      # one offset a WRITE in the region (uint64)
    dst: np.ndarray      # and in the weights
    lengths: np.ndarray  # its bytes


class Batch:
    """Some jobs of one layer: where their codes and scales sit in the staging half, and
    one command per inference rank of their WRITEs (another from the shard, for bf16)."""

    def __init__(self, trainer, group, half, fp8, bf16):
        xp, t0s = trainer.ops.xp, trainer.plan.rows[trainer.t]
        self.group, self.half, self.jobs, self.prepared = group, half, [], []
        at, staged, direct, src, dst = half * trainer.half, {}, {}, [], []
        for job in fp8:
            codes, scales = at, at + aligned(job.bytes)
            at = scales + aligned(job.scale_bytes)
            self.jobs.append((job, codes))
            if job.scale_bytes:  # the scales of the blocks that begin in our rows
                b0, b1 = job.blocks
                cols = job.col0 // BLOCK + np.arange(job.width // BLOCK)
                src += [trainer.block_index(job.p, b, cols) for b in range(b0, b1)]
                dst.append(scales // 4 + np.arange(job.scale_bytes // 4))
            for w in job.writes:
                staged.setdefault(job.r, []).append(
                    ((codes if w.what == "data" else scales) + w.src, w.dst, w.length))
        for job in bf16:
            t0 = t0s[job.p.index][0]
            first = 2 * (trainer.shard_at[job.p.index] + (job.lo - t0) * job.p.cols)
            for w in job.writes:
                direct.setdefault(job.r, []).append((first + w.src, w.dst, w.length))
        self.scale_src = xp.asarray(np.concatenate(src) if src else np.zeros(0, np.int64))
        self.scale_dst = xp.asarray(np.concatenate(dst) if dst else np.zeros(0, np.int64))
        self.commands = [Command(source, r, *np.array(w, np.uint64).T.copy())
                         for source, lists in (("staging", staged), ("shard", direct))
                         for r, w in sorted(lists.items())]
        self.commands_to = {c.rank for c in self.commands}
        self.writes = sum(len(c.lengths) for c in self.commands)
        self.bytes = int(sum(c.lengths.sum() for c in self.commands))

    def quantise(self, trainer):
        ops, rows = trainer.ops, trainer.plan.rows[trainer.t]
        for job, codes in self.jobs:
            p, t0 = job.p, rows[job.p.index][0]
            at = trainer.block_index(p, job.lo // BLOCK, 0)
            ops.codes(trainer.view(p)[job.lo - t0:job.hi - t0], job.lo, trainer.scales[at:],
                      p.cols // BLOCK, job.col0, job.width,
                      trainer.staging[codes:codes + job.bytes])
        if len(self.scale_src):
            trainer.staging.view(ops.xp.float32)[self.scale_dst] = trainer.scales[self.scale_src]

    def submit(self, trainer, n):
        return [command.write(imm(n, self.group)) for command in self.prepared]


# %% [markdown]
# ## Code: an inference rank's side, and the naive way

# %%
class Inference:
    """Inference rank r: its weight region, laid out by its tensors, and the count of
    WRITEs each layer brings (from the plan)."""

    def __init__(self, eng, plan, r, ops, seed, peers):
        self.eng, self.plan, self.r, self.ops, self.peers = eng, plan, r, ops, peers
        self.tensors = plan.layouts[r]
        self.weights = ops.xp.zeros(max(self.tensors[-1].end, 1), ops.xp.uint8)
        self.region = eng.register(self.weights)
        self.counts = {g: c for g, c in plan.counts(r).items() if c}
        self.senders = {g: [t for t in range(plan.trainers) if any(
            job.r == r for job in plan.jobs[t][g])] for g in self.counts}
        self.check = Check(plan.params, self.tensors, self.weights, ops.xp, seed)

    def receive(self, n, fail=False):
        """Wait for every layer's WRITEs by count, in any order, then the barrier: from
        then on this rank serves update n's weights. A trainer gone: which layers are
        stale, in one line."""
        done = []
        try:
            for g, count in self.counts.items():
                self.eng.expect(imm(n, g), count)
                self.ops.sync()  # the copies of a GPU-to-GPU WRITE on shm, done
                for t in self.senders[g]:
                    self.eng.signal(self.peers[t], imm(n, LANDED | g))
                done.append(g)
                if fail:
                    harness.fail_here(f"inference rank {self.r}", n)
            self.eng.group(list(self.peers.values())).barrier(imm(n, BARRIER))
        except TimeoutError as e:
            complete = sum(self.eng.arrived(imm(n, g)) >= c for g, c in self.counts.items()
                           if g not in done)
            raise TimeoutError(f"inference rank {self.r}: update {n}: {e}; {complete} of the "
                               f"{len(self.counts) - len(done)} layers not taken yet have "
                               "all theirs") from None
        except launch.PeerGone as e:
            stale = [g for g, count in self.counts.items()
                     if g not in done and self.eng.arrived(imm(n, g)) < count]
            raise launch.PeerGone(f"inference rank {self.r}: update {n} incomplete, "
                                  f"{layers_named(stale)} stale (not all their WRITEs came), "
                                  f"not serving this model ({e})") from None


# %% [markdown]
# ## Main: who is who, the layouts exchanged, the updates

# %%
def run(eng, group, args, trainers, model, inference_model, ops, gpu):
    """What both sides share, in the engine harness.main opened: a connection to every
    rank, the layouts exchanged and the plan from them; then this rank's side; then the
    report."""
    me, world = group.rank, group.world
    peers = {k: eng.connect(a) for k, a in enumerate(group.allgather(eng.address()))
             if k != me}
    # the one place the two sides part: what each knows of itself, and its story below
    if me < trainers:  # a trainer: the parameters it trains
        side, mine = trainer, [[p.name, p.rows, p.cols, p.fp8, p.group] for p in parameters(model)]
    else:  # an inference rank: the tensors it serves, and from which pieces of which
        side, mine = inference, inference_tensors(inference_model, world - trainers, me - trainers)
    # both sides' layouts, as each side knows its own, to every rank: the plan from them
    metas = harness.everyone(group, mine)
    params = [Param(i, *m) for i, m in enumerate(metas[0])]
    plan = Plan(params, trainers, [lay_out(m) for m in metas[trainers:]], eng.max_write)
    if me == 0:
        harness.say_setup(args, eng, peers, model, plan)
    report = Report(me, args, plan, eng, ops, trainers, gpu)
    side(eng, group, peers, plan, ops, args, report)  # trainer() or inference(): chosen above
    return report.finish()


# %% [markdown]
# ## Main: each side's updates

# %%
def trainer(eng, group, peers, plan, ops, args, report):
    """A trainer: its shards, staging and edge buffer registered (trainer 0's also a
    buffer to gather whole tensors in, for the naive way). Each update: the training
    step's new values, then its WRITEs into every inference rank (Trainer.update: edge
    maxima, quantise, WRITE, barrier); its seconds go to the report."""
    me, trainers, naive_way = group.rank, plan.trainers, args.naive == "yes"
    side = Trainer(eng, plan, me, ops, args.seed, args.staging,
                   naive.staging_at_least(plan) if naive_way and me == 0 else 0)
    if naive_way and me == 0:  # the naive way gathers whole tensors on trainer 0
        naive.add_gather(side)
    # every rank's regions: we WRITE into the inference ranks' weights and the other
    # trainers' edge buffers (the naive way: into the inboxes and trainer 0's gather buffer)
    remote = harness.exchange(group, eng, {"edges": side.regions["edges"],
                                           "gather": side.regions.get("gather")})
    made = time.perf_counter()
    side.connect(peers, [r["weights"] for r in remote[trainers:]],
                 {u: remote[u]["edges"] for u in range(trainers) if u != me})
    if me == 0:
        print(f"trainer 0: staging {2 * side.half / 1e6:.1f} MB (two halves, each a layer's "
              f"quantised rows); {sum(len(b.prepared) for b in side.batches)} commands made "
              f"in {1e3 * (time.perf_counter() - made):.1f} ms, once", flush=True)
    for n, last, versions in harness.updates(args, plan.params):
        side.fill(versions)  # the training step
        group.barrier()
        if last:  # the naive way: trainer 0 gathers, quantises and sends everything
            mine = {"seconds": naive.naive_trainer(side, n, remote)}
        else:
            fail = args.fail == "trainer" and n == 2 and me == trainers - 1
            try:
                mine = side.update(n, fail)
            except launch.PeerGone as e:
                raise launch.PeerGone(f"trainer {me}: update {n} stopped ({e})") from None
        report.update(n, last, harness.everyone(group, mine))


def inference(eng, group, peers, plan, ops, args, report):
    """An inference rank: its weights registered (and for the naive way an inbox of the
    largest whole tensor). Each update: every layer's WRITEs waited for by count and the
    barrier (Inference.receive), then every weight and scale checked, for the report."""
    me, naive_way = group.rank, args.naive == "yes"
    side = Inference(eng, plan, me - plan.trainers, ops, args.seed, peers)
    inbox = naive.inbox(plan, ops.xp) if naive_way else None
    # every rank's regions (ours the trainers WRITE into; we WRITE into none)
    harness.exchange(group, eng, {"weights": side.region,
                                  "inbox": eng.register(inbox) if naive_way else None})
    before = {}
    for n, last, versions in harness.updates(args, plan.params):
        group.barrier()
        if last:  # the naive way: each whole tensor into the inbox, our slices out of it
            naive.naive_inference(side, n, inbox)
        else:
            side.receive(n, args.fail == "inference" and n == 2 and me == group.world - 1)
        report.update(n, last, harness.everyone(group, side.check(versions, before)))
        before = versions


if __name__ == "__main__":
    cli.run(lambda: harness.main(__doc__, __file__, KERNELS, run))

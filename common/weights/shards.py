"""A trainer's memory in chapter 19: its rows of every parameter (FSDP's dim-0 shards, bf16)
in one array, the block maxima and scales of its fp8 rows, the training step that gives
them new values, and the size of its staging. Chapter 19's Trainer is one of these, with
its staging, its edge buffer and its batches of WRITEs.
"""
from common.gpu.layout import aligned
from common.weights import BLOCK
from common.weights.model import values


def staging_half(layers, t, staging):
    """Bytes of each of trainer t's two staging halves: its largest layer's quantised rows
    (`layers`: {group: [Job]}, the plan's for t), or half of --staging (`staging`), refused
    in one line where it cannot hold that."""
    need = max([sum(aligned(j.bytes) + aligned(j.scale_bytes) for j in jobs if j.p.fp8)
                for jobs in layers.values()] + [64])  # 64: a trainer of no rows
    if staging is not None and staging < 2 * need:
        raise ValueError(f"--staging {staging}: trainer {t} quantises up to {need} B a "
                         f"layer, into each of two halves: give at least {2 * need}")
    return aligned(need if staging is None else staging // 2)


class Shards:
    """`rows`: this trainer's [t0, t1) of each of `params`; `ops`: where its arrays live
    (numpy or cupy) and quantising runs; `seed`: of the values the training step makes."""

    def __init__(self, params, rows, ops, seed):
        self.params, self.rows, self.ops, self.seed = params, rows, ops, seed
        xp = ops.xp
        self.shard_at, self.amax_at, at, blocks = {}, {}, 0, 0
        for p in params:
            t0, t1 = rows[p.index]
            self.shard_at[p.index], at = at, at + (t1 - t0) * p.cols
            if p.fp8 and t0 < t1:
                self.amax_at[p.index], blocks = blocks, blocks + self.blocks(p)
        self.shard = xp.zeros(max(at, 1), xp.uint16)
        self.amax, self.scales = xp.zeros(blocks + 1, xp.float32), xp.zeros(blocks + 1, xp.float32)
        self.versions = {}

    def view(self, p):
        """Our rows of p, (t1 - t0) x p.cols, over the shard array."""
        t0, t1 = self.rows[p.index]
        at = self.shard_at[p.index]
        return self.shard[at:at + (t1 - t0) * p.cols].reshape(t1 - t0, p.cols)

    def blocks(self, p):
        """How many block maxima of p this trainer keeps: its block rows x p's columns."""
        t0, t1 = self.rows[p.index]
        return ((t1 - 1) // BLOCK - t0 // BLOCK + 1) * (p.cols // BLOCK)

    def block_index(self, p, b, col_blocks):
        """Where block row b (of the whole tensor), columns `col_blocks`, of p are in our
        amax and scales."""
        t0 = self.rows[p.index][0]
        return self.amax_at[p.index] + (b - t0 // BLOCK) * (p.cols // BLOCK) + col_blocks

    def local_maxima(self):
        """The largest magnitude of our rows of each block of every fp8 parameter, into
        amax (where 128 rows straddle two trainers, ours of them only)."""
        for index, at in self.amax_at.items():
            p = self.params[index]
            self.ops.amax(self.view(p), self.rows[index][0], self.amax[at:at + self.blocks(p)])

    def fill(self, versions):
        """The training step's result: new values of the parameters whose version moved."""
        for p in self.params:
            if self.versions.get(p.index) != versions[p.index] and p.index in self.shard_at:
                t0, t1 = self.rows[p.index]
                if t0 < t1:
                    self.view(p)[...] = values(self.ops.xp, self.seed, p, versions[p.index],
                                               t0, t1)
        self.versions = dict(versions)
        self.ops.sync()

"""The bookkeeping of an expert-parallel all-to-all, whatever moves the bytes: the layer's
shape and the checks of its inputs, the wire format, where each (token, expert) selection
goes and where it lands, the weighted sum of combine, and the order of the four halves.
Chapters 16 and 17 and the NCCL baseline (common/moe/nccl.py) share it; it runs on
numpy or cupy arrays (`xp`).
"""
import numpy as np

from common.gpu import rounding
from common.gpu.layout import aligned


class Shape:
    """One MoE layer over `world` ranks; rank r hosts experts r * local .. (r + 1) * local - 1.

    A sender can send one receiver at most max_tokens * min(topk, local) tokens (a
    token's experts are distinct): per_peer bounds what arrives from one sender."""

    def __init__(self, world, experts, max_tokens, topk, hidden, dtype):
        self.world, self.experts, self.local = world, experts, experts // world
        self.max_tokens, self.topk, self.hidden, self.dtype = max_tokens, topk, hidden, dtype
        # one token on the wire: fp8 codes + a float32 scale per 128 values, or bf16
        self.row = hidden + hidden // rounding.FP8_BLOCK * 4 if dtype == "fp8" else 2 * hidden
        self.out_row = 2 * hidden  # combine: bf16
        self.per_peer = max_tokens * min(topk, self.local)

    def lay_out(self, sections):
        """Put `sections` [(name, bytes)] one after another, each aligned: self.<name> is
        where it starts (the same offsets on every rank), self.size the whole region."""
        at = 0
        for name, size in sections:
            setattr(self, name, at)
            at += aligned(size)
        self.size = at


class Stages:
    """dispatch send -> dispatch receive -> combine send -> combine receive, in that order."""
    stage = "idle"

    def _stage(self, expected, then):
        if self.stage != expected:
            raise ValueError(f"out of order: this step follows {expected!r}, "
                             f"but the last one done was {self.stage!r}")
        self.stage = then


def check_shape(world, max_tokens, experts, topk, hidden, dtype, private, combine="bf16"):
    """Bad layer shapes, refused before anything is opened (one line each)."""
    if max_tokens < 1 or hidden < 1 or private < 0:
        raise ValueError("need max tokens >= 1, hidden >= 1, private tokens >= 0")
    if experts < 1 or experts % world:
        raise ValueError(f"{experts} experts do not split evenly over {world} ranks")
    if not 1 <= topk <= experts:
        raise ValueError(f"top-k ({topk}) must be 1..{experts} (the number of experts)")
    if dtype not in ("fp8", "bf16"):
        raise ValueError(f"dispatch dtype must be fp8 or bf16, not {dtype!r}")
    if combine != "bf16":  # what the published kernels send back too; summed in float32
        raise ValueError(f"combine dtype must be bf16, not {combine!r}")
    if dtype == "fp8" and hidden % rounding.FP8_BLOCK:
        raise ValueError(f"fp8 needs hidden ({hidden}) to be a multiple of {rounding.FP8_BLOCK}")


OUT_OF_RANGE, TWICE = 1, 2  # what is wrong with a batch's expert indices (0: nothing)


def index_error(code, experts):
    return {OUT_OF_RANGE: f"expert index out of range 0..{experts - 1}",
            TWICE: "a token names the same expert twice"}[code]


def check_tokens(xp, x, indices, L, values=True, keep=(np.int64,)):
    """Refuse a batch that does not fit, before a byte of it is written anywhere.
    values=False leaves the indices' values to the caller (a kernel that checks them
    on the GPU, where reading a verdict back would cost a wait). Returns the indices,
    as they are if of a dtype in `keep`, else as int64."""
    indices = xp.asarray(indices)
    n = len(indices)
    if n > L.max_tokens:
        raise ValueError(f"{n} tokens, more than the maximum of {L.max_tokens}")
    if x.shape != (n, L.hidden) or indices.shape != (n, L.topk):
        raise ValueError(f"tokens must be ({n}, {L.hidden}) and indices ({n}, {L.topk}), "
                         f"got {x.shape} and {indices.shape}")
    if not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(f"expert indices must be integers, got {indices.dtype}")
    if values and n:  # one look at the verdicts (on a GPU, one wait)
        verdicts = xp.stack([((indices < 0) | (indices >= L.experts)).any(),
                             (xp.diff(xp.sort(indices, axis=1), axis=1) == 0).any()])
        for code, bad in zip((OUT_OF_RANGE, TWICE), verdicts.tolist()):
            if bad:
                raise ValueError(index_error(code, L.experts))
    return indices if indices.dtype in keep else indices.astype(xp.int64)


class Wire:
    """The dispatch dtype on the wire: fp8 e4m3 codes with their float32 block scales,
    or bf16; one row of bytes per token."""

    def __init__(self, dtype, hidden, mem):
        self.dtype, self.hidden, self.mem, self.xp = dtype, hidden, mem, mem.xp

    def encode(self, x):
        """float32 tokens (n, hidden) -> rows (n, row bytes)."""
        if self.dtype == "bf16":
            return rounding.to_bf16(x).view(self.xp.uint8)
        return self.mem.quantize_fp8(x)

    def split(self, rows):
        """Rows -> (tokens, scales): uint8 e4m3 codes and float32 scales, or bf16 and None."""
        if self.dtype == "bf16":
            return rows.view(self.xp.uint16), None
        h = self.hidden
        return rows[:, :h], self.xp.ascontiguousarray(rows[:, h:]).view(self.xp.float32)

    def decode(self, tokens, scales):
        """Back to float32, on the host (for the checks)."""
        tokens = self.mem.host(tokens)
        if scales is None:
            return rounding.from_bf16(tokens)
        return rounding.dequantize_fp8(np.ascontiguousarray(tokens), self.mem.host(scales))


def send_plan(xp, indices, experts):
    """The (token, expert) selections sorted by expert, so by rank, then by token:
    `order` (positions in indices.ravel()), and the count per expert (on the host)."""
    flat = indices.ravel()
    if not len(flat):
        return xp.zeros(0, xp.int64), np.zeros(experts, np.int32)
    order = xp.argsort(flat * len(flat) + xp.arange(len(flat)))  # unique keys: stable
    counts = xp.bincount(flat, minlength=experts).astype(xp.int32)
    return order, np.asarray(counts if xp is np else counts.get())


def receive_plan(matrix, rank, local):
    """What rank `rank` receives, from the count matrix [source, expert]: the rows from
    each source, and `gather`: for each expert-major row (by local expert, then source,
    then the source's token order), where it is in the senders' streams put end to end."""
    mine = matrix[:, rank * local:(rank + 1) * local]  # [source, local expert]
    from_each = mine.sum(axis=1)
    stream_start = np.cumsum(from_each) - from_each  # [source]
    within = np.cumsum(mine, axis=1) - mine          # [source, expert]: before that expert
    starts = (stream_start[:, None] + within).T.ravel()  # each (expert, source) slice
    lengths = mine.T.ravel()
    before = np.cumsum(lengths) - lengths  # where each slice starts in the output
    gather = np.repeat(starts - before, lengths) + np.arange(lengths.sum())
    return from_each, gather, mine.sum(axis=0)


def weighted_sum(xp, rows, order, weights, hidden):
    """combine's last step: bf16 rows in send order -> per token, the weighted sum."""
    n, topk = weights.shape
    values = xp.empty((n * topk, hidden), xp.float32)
    values[order] = rounding.from_bf16(rows.view(xp.uint16).reshape(n * topk, hidden))
    return (weights[:, :, None] * values.reshape(n, topk, hidden)).sum(axis=1)

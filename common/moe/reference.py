"""What MoE dispatch and combine must produce, computed the plain way (numpy), and the
inputs to check them with.

Wire formats (numpy has neither dtype, so both travel as raw integers):
- fp8 e4m3 ("e4m3fn": 1 sign, 4 exponent bits with bias 7, 3 mantissa bits,
  largest finite value 448, no infinities) in uint8, with one float32 scale per
  block of 128 values: x ~ decode(q) * scale, scale = max|x| of the block / 448.
- bf16 (the top half of a float32, rounded to nearest even) in uint16.

Layout: expert e lives on rank e // (experts / world). dispatch gives each rank,
for each of its experts in turn, the tokens routed to it, ordered by source
rank and then token index; combine gives each source token the weighted sum of
what its experts returned.
"""
import numpy as np

FP8_BLOCK = 128     # values per fp32 scale
FP8_MAX = 448.0     # largest finite e4m3 value


def _e4m3_values():
    """The value of each non-negative finite e4m3 code 0..126, increasing."""
    codes = np.arange(127)
    exponent, mantissa = codes >> 3, (codes & 7).astype(np.float64)
    return np.where(exponent == 0, mantissa / 8 * 2.0 ** -6,
                    (1 + mantissa / 8) * 2.0 ** (exponent - 7)).astype(np.float32)


E4M3 = _e4m3_values()


def to_e4m3(x):
    """float32 -> uint8 e4m3 codes: nearest value (ties to the even code), saturating at
    +-448 as fp8 conversions for training do. numpy, or cupy for a cupy array."""
    xp = array_module(x)
    table = xp.asarray(E4M3)
    a = xp.minimum(xp.abs(x).astype(xp.float32), FP8_MAX)
    upper = xp.clip(xp.searchsorted(table, a), 1, len(E4M3) - 1)
    lower = upper - 1
    below, above = a - table[lower], table[upper] - a
    pick_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = xp.where(pick_upper, upper, lower).astype(xp.uint8)
    return code | xp.where(xp.signbit(x), 0x80, 0).astype(xp.uint8)


def from_e4m3(code):
    value = E4M3[code & 0x7F]
    return np.where(code & 0x80, -value, value).astype(np.float32)


def array_module(array):
    """numpy, or cupy for a cupy array: the bf16 conversions run on either."""
    if type(array).__module__.partition(".")[0] == "cupy":
        import cupy
        return cupy
    return np


def to_bf16(x):
    """float32 -> uint16 bf16, rounded to nearest even (NaN stays NaN)."""
    xp = array_module(x)
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    bits = x.view(xp.uint32)
    rounded = (bits >> 16) & 1
    rounded += 0x7FFF
    rounded += bits  # wraps only for NaNs with every bit set, replaced below
    half = (rounded >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(x), xp.uint16(0x7FC0), half)


def from_bf16(half):
    xp = array_module(half)
    return (xp.asarray(half, dtype=xp.uint16).astype(xp.uint32) << 16).view(xp.float32)


def quantize_fp8(x, block_rows=1):
    """(rows, cols) float32 -> (uint8 codes (rows, cols), float32 scales (rows / block_rows,
    cols / 128)): one scale per block of block_rows x 128 values, 1 x 128 for activations
    (chapters 16-17), 128 x 128 for weights as fp8 checkpoints keep them (chapter 19).
    numpy, or cupy for a cupy array."""
    xp = array_module(x)
    rows, cols = x.shape
    blocks = x.reshape(rows // block_rows, block_rows, cols // FP8_BLOCK, FP8_BLOCK)
    scales = fp8_scales(xp.abs(blocks).max(axis=(1, 3)))
    codes = to_e4m3(blocks / scales[:, None, :, None])
    return codes.reshape(x.shape), scales


def fp8_scales(amax):
    """A block's scale from its largest magnitude: amax / 448, or 1 where all are zero."""
    xp = array_module(amax)
    return xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(xp.float32)


def dequantize_fp8(codes, scales):
    blocks = from_e4m3(codes).reshape(len(codes), codes.shape[1] // FP8_BLOCK, FP8_BLOCK)
    return (blocks * scales[:, :, None]).reshape(codes.shape)


def wire_rows(dtype, x):
    """float32 tokens -> what travels, one row of bytes per token: e4m3 codes then the
    float32 scales (fp8), or bf16."""
    if dtype == "bf16":
        return to_bf16(x).view(np.uint8)
    codes, scales = quantize_fp8(x)
    return np.concatenate([codes, scales.view(np.uint8)], axis=1)


def round_trip(dtype, x):
    """What a receiver can know of x after the wire: x quantised and back, in float32."""
    if dtype == "bf16":
        return from_bf16(to_bf16(x))
    return dequantize_fp8(*quantize_fp8(x))


# --- inputs ------------------------------------------------------------------------

CASES = {  # name: what it checks
    "random": "random top-k of distinct experts, every rank at the maximum",
    "empty-expert": "one expert receives nothing",
    "silent-rank": "the last rank sends nothing",
    "one-expert": "every token goes to the same top-k set (expert 0 receives everything)",
    "fewer": "fewer tokens than the maximum, a different number on each rank",
    "overflow": "a private region of one token per sender, so nearly all tokens overflow",
}


def routing(case, seed, rank, world, max_tokens, experts, topk):
    """(indices (n, topk) int32, weights (n, topk) float32) of `rank` for `case`.
    Every rank can compute every rank's routing: the check needs no exchange."""
    rng = np.random.default_rng([seed, rank, 1])
    n = max_tokens
    if case == "silent-rank" and rank == world - 1:
        n = 0
    elif case == "fewer":
        n = int(rng.integers(0, max_tokens)) if max_tokens > 1 else 0
    pool = experts
    if case == "empty-expert":
        pool = experts - 1  # draws from 0..E-2, then shifted to skip the chosen expert
    if case == "one-expert":
        indices = np.tile(np.arange(topk), (n, 1))
    else:
        indices = np.argsort(rng.random((n, pool)), axis=1)[:, :topk]
        if case == "empty-expert":
            skipped = int(np.random.default_rng([seed, 2]).integers(experts))
            indices = np.where(indices >= skipped, indices + 1, indices)
    weights = rng.random((n, topk)).astype(np.float32) + 0.1
    return indices.astype(np.int32), (weights / weights.sum(axis=1, keepdims=True)).astype(
        np.float32)


def tokens(seed, rank, n, hidden):
    return np.random.default_rng([seed, rank, 2]).standard_normal((n, hidden)).astype(np.float32)


def expert_factor(expert, experts):
    """The checks' expert function is x -> factor * x, a different factor per expert,
    so that a token answered by the wrong expert shows."""
    return 1.0 + expert / experts


# --- the reference ---------------------------------------------------------------------

def dispatch(rank, world, experts, indices_of, rows_of):
    """What `rank` must receive: (rows expert-major, counts per local expert).

    indices_of[s]: rank s's routing (n_s, topk); rows_of[s]: its token rows, in
    whatever wire format (one row per token, any dtype).
    """
    local = experts // world
    counts = np.zeros(local, dtype=np.int64)
    parts = []
    for e in range(rank * local, (rank + 1) * local):
        for s in range(world):
            chosen = np.nonzero((indices_of[s] == e).any(axis=1))[0]  # in token order
            parts.append(rows_of[s][chosen])
            counts[e - rank * local] += len(chosen)
    width = rows_of[0].shape[1:]
    rows = np.concatenate(parts) if parts else np.zeros((0, *width), rows_of[0].dtype)
    return rows, counts


def combine(indices, weights, expert_outputs):
    """Per source token, the weighted sum over its experts, in float32.
    expert_outputs[t, j]: what expert indices[t, j] returned for token t (float32)."""
    return (weights[:, :, None] * expert_outputs).sum(axis=1)

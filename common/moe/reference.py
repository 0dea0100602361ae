"""What MoE dispatch and combine must produce, computed the plain way (numpy), and the
inputs to check them with.

Wire formats (common/gpu/rounding.py): fp8 e4m3 codes with one float32 scale per block of
128 values, or bf16.

Layout: expert e lives on rank e // (experts / world). dispatch gives each rank,
for each of its experts in turn, the tokens routed to it, ordered by source
rank and then token index; combine gives each source token the weighted sum of
what its experts returned.
"""
import numpy as np

from common.gpu.rounding import dequantize_fp8, from_bf16, quantize_fp8, to_bf16


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

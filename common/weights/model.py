"""The two sides of chapter 19's weight update: the model's parameters as trainers hold
them (bf16, FSDP's dim-0 shards) and the tensors an inference rank serves (fp8 with
128 x 128 block scales, tensor- and expert-parallel, projections fused), where each lives
in a rank's memory, and the values the tests and the checks compute on both sides.
"""
from typing import NamedTuple

from common.cli import UsageError
from common.gpu import rounding
from common.gpu.layout import aligned  # every tensor starts on a cache line
from common.weights import BLOCK

MODELS = {  # Qwen3-30B-A3B's config.json; tiny: the same structure at toy sizes, for tests
    "qwen3-30b-a3b": dict(layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                          experts=128, intermediate=768, vocab=151936),
    "tiny": dict(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=128, experts=4,
                 intermediate=256, vocab=512),
}


class Param:
    """A training parameter: 2-D (rows, cols), or 1-D as (n, 1); `group`: its layer + 1,
    0 for those outside the layers (each group is one immediate per update)."""

    def __init__(self, index, name, rows, cols, fp8, group):
        self.index, self.name, self.rows, self.cols = index, name, rows, cols
        self.fp8, self.group = fp8, group

    def __repr__(self):
        return f"Param({self.name}, {self.rows}x{self.cols})"


def parameters(m):
    """The model's parameters in Hugging Face's names; fp8 where Qwen's fp8 checkpoints
    quantise them (attention and expert projections), bf16 for the rest."""
    q, kv, h, i = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["hidden"], \
        m["intermediate"]
    shapes = [("model.embed_tokens.weight", m["vocab"], h, False, 0)]
    for layer in range(m["layers"]):
        at, g = f"model.layers.{layer}.", layer + 1
        shapes += [(at + "input_layernorm.weight", h, 1, False, g),
                   (at + "self_attn.q_proj.weight", q, h, True, g),
                   (at + "self_attn.k_proj.weight", kv, h, True, g),
                   (at + "self_attn.v_proj.weight", kv, h, True, g),
                   (at + "self_attn.o_proj.weight", h, q, True, g),
                   (at + "self_attn.q_norm.weight", m["head_dim"], 1, False, g),
                   (at + "self_attn.k_norm.weight", m["head_dim"], 1, False, g),
                   (at + "post_attention_layernorm.weight", h, 1, False, g),
                   (at + "mlp.gate.weight", m["experts"], h, False, g)]
        for e in range(m["experts"]):
            shapes += [(at + f"mlp.experts.{e}.{w}_proj.weight", rows, cols, True, g)
                       for w, rows, cols in (("gate", i, h), ("up", i, h), ("down", h, i))]
    shapes += [("model.norm.weight", h, 1, False, 0), ("lm_head.weight", m["vocab"], h, False, 0)]
    return [Param(n, *s) for n, s in enumerate(shapes)]


def layers_named(groups):
    """Groups (a layer + 1, or 0) in words, for a message: the first six named."""
    names = ["outside the layers" if g == 0 else f"layer {g - 1}" for g in groups]
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "") \
        if names else "no layer"


def shard_rows(rows, trainers, t):
    """FSDP2's dim-0 shard of trainer t: ceil(rows / trainers) rows each, the last short."""
    chunk = -(-rows // trainers)
    return min(rows, t * chunk), min(rows, (t + 1) * chunk)


class Piece(NamedTuple):
    """Rows [row0, row1) x cols [col0, col1) of the training parameter `source` (whole:
    source_rows x source_cols) go to an inference tensor's rows from `at_row` on. Sent
    between ranks as JSON: a list, made a Piece again by Tensor."""
    source: str
    source_rows: int
    source_cols: int
    row0: int
    row1: int
    col0: int
    col1: int
    at_row: int


def inference_tensors(m, n, r):
    """Inference rank r of n: its tensors as [name, fp8, rows, cols, [Piece]]. Attention is
    tensor-parallel over n (q/k/v by output rows, fused; o_proj by input columns), the
    experts expert-parallel (whole, fused gate/up), embeddings and lm_head by vocabulary
    rows, norms and the router replicated."""
    q, kv, h, i = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["hidden"], \
        m["intermediate"]
    for what, size in (("q heads' rows", q), ("KV heads' rows", kv), ("experts", m["experts"]),
                       ("vocabulary", m["vocab"])):
        if size % n:
            raise ValueError(f"{n} inference ranks do not divide the model's {size} {what}")

    def whole(name, rows, cols, at=0):
        return Piece(name, rows, cols, 0, rows, 0, cols, at)

    def rows_of(name, rows, cols, at=0):  # rank r's 1/n of the rows
        part = rows // n
        return Piece(name, rows, cols, r * part, (r + 1) * part, 0, cols, at)

    v = m["vocab"]
    tensors = [["model.embed_tokens.weight", False, v // n, h,
                [rows_of("model.embed_tokens.weight", v, h)]]]
    for layer in range(m["layers"]):
        at = f"model.layers.{layer}."
        for name, size in (("input_layernorm", h), ("self_attn.q_norm", m["head_dim"]),
                           ("self_attn.k_norm", m["head_dim"]),
                           ("post_attention_layernorm", h)):
            tensors.append([at + name + ".weight", False, size, 1,
                            [whole(at + name + ".weight", size, 1)]])
        sa = at + "self_attn."
        tensors.append([sa + "qkv_proj.weight", True, (q + 2 * kv) // n, h,
                        [rows_of(sa + "q_proj.weight", q, h),
                         rows_of(sa + "k_proj.weight", kv, h, q // n),
                         rows_of(sa + "v_proj.weight", kv, h, (q + kv) // n)]])
        part = q // n
        tensors.append([sa + "o_proj.weight", True, h, part, [
            Piece(sa + "o_proj.weight", h, q, 0, h, r * part, (r + 1) * part, 0)]])
        tensors.append([at + "mlp.gate.weight", False, m["experts"], h,
                        [whole(at + "mlp.gate.weight", m["experts"], h)]])
        per = m["experts"] // n
        for e in range(r * per, (r + 1) * per):
            ex = at + f"mlp.experts.{e}."
            tensors.append([ex + "gate_up_proj.weight", True, 2 * i, h,
                            [whole(ex + "gate_proj.weight", i, h),
                             whole(ex + "up_proj.weight", i, h, at=i)]])
            tensors.append([ex + "down_proj.weight", True, h, i,
                            [whole(ex + "down_proj.weight", h, i)]])
    tensors.append(["model.norm.weight", False, h, 1, [whole("model.norm.weight", h, 1)]])
    tensors.append(["lm_head.weight", False, v // n, h, [rows_of("lm_head.weight", v, h)]])
    return tensors


class Tensor:
    """An inference tensor where it lives in its rank's weight region: codes (or bf16
    values) at `offset`, fp8 scales ((rows / 128) x (cols / 128) float32) at `scales`."""

    def __init__(self, name, fp8, rows, cols, pieces, offset):
        self.name, self.fp8, self.rows, self.cols = name, fp8, rows, cols
        self.pieces = [Piece(*piece) for piece in pieces]
        self.offset = offset
        self.bytes = rows * cols * (1 if fp8 else 2)
        self.scales = aligned(offset + self.bytes)
        self.end = aligned(self.scales + (rows // BLOCK) * (cols // BLOCK) * 4 if fp8 else
                           self.scales)


def lay_out(tensors):
    """[Tensor] at consecutive offsets (the last one's end: the region's size)."""
    out, at = [], 0
    for t in tensors:
        out.append(Tensor(*t, at))
        at = out[-1].end
    return out



def views(xp, weights, tensor):
    """(codes or bf16 values, scales or None) of `tensor`, as arrays over `weights`, the
    region of its inference rank."""
    data = weights[tensor.offset:tensor.offset + tensor.bytes]
    if not tensor.fp8:
        return data.view(xp.uint16).reshape(tensor.rows, tensor.cols), None
    size = (tensor.rows // BLOCK) * (tensor.cols // BLOCK) * 4
    scales = weights[tensor.scales:tensor.scales + size].view(xp.float32)
    return data.reshape(tensor.rows, tensor.cols), \
        scales.reshape(tensor.rows // BLOCK, tensor.cols // BLOCK)

def check_piece(names, r, tensor, piece):
    """The trainers' parameter (from `names`, name -> Param) that inference rank r's
    `piece` of `tensor` takes its rows from, once the name, the shape and the piece's
    bounds agree with what the trainers hold; else ValueError, one line, the first
    mismatch."""
    name, rows, cols = piece.source, piece.source_rows, piece.source_cols
    p = names.get(name)
    if p is None:
        within = f" (in {tensor.name})" if tensor.name != name else ""
        raise ValueError(f"inference rank {r} asks for {name}{within}, which the trainers do "
                         "not hold")
    if (p.rows, p.cols) != (rows, cols):
        raise ValueError(f"{name}: the trainers hold {p.rows} x {p.cols}, inference rank {r} "
                         f"expects {rows} x {cols}")
    row0, row1, col0, col1 = piece.row0, piece.row1, piece.col0, piece.col1
    if not (0 <= row0 < row1 <= rows and 0 <= col0 < col1 <= cols):
        raise ValueError(f"{tensor.name} on inference rank {r}: rows {row0}..{row1} x cols "
                         f"{col0}..{col1} are outside {name}'s {rows} x {cols}")
    if not p.fp8 and (col0, col1) != (0, cols):
        raise ValueError(f"{tensor.name} on inference rank {r}: bf16 pieces take whole rows")
    if p.fp8 and any(x % BLOCK for x in (row0, row1, col0, col1, piece.at_row)):
        raise ValueError(f"{tensor.name} on inference rank {r}: its piece of {name} (rows "
                         f"{row0}..{row1}, cols {col0}..{col1}) is not on the {BLOCK} x "
                         f"{BLOCK} fp8 blocks: use fewer inference ranks")
    return p


def checksum(xp, data):
    """Of a tensor's bytes (its region, 64-byte aligned): odd weights per 8 bytes, so a
    change anywhere shows."""
    words = data.view(xp.uint64)
    return int((words * (xp.arange(len(words), dtype=xp.uint64) * xp.uint64(2) + xp.uint64(1)))
               .sum())


def values(xp, seed, p, version, lo, hi):
    """Rows [lo, hi) of parameter p at `version`, bf16 (uint16), the same on every rank
    and in numpy and cupy: a hash of each value's index, scaled per row so that blocks
    have different scales. Made in pieces of 16M values (the hash needs 8 bytes each)."""
    out = xp.empty((hi - lo, p.cols), xp.uint16)
    key = xp.uint64((seed * 1000003 + p.index) * 1000003 + version & (1 << 64) - 1)
    step = max(1, (1 << 24) // p.cols)
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        z = xp.arange(a * p.cols, b * p.cols, dtype=xp.uint64) ^ key
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> xp.uint64(shift))) * xp.uint64(factor)  # splitmix64
        z ^= z >> xp.uint64(31)
        u = (z >> xp.uint64(40)).astype(xp.float32) * xp.float32(2.0 ** -23) - xp.float32(1)
        row = 2.0 ** ((xp.arange(a, b, dtype=xp.float32) * 7 + p.index) % 9 - 6)
        out[a - lo:b - lo] = rounding.to_bf16(u.reshape(b - a, p.cols)
                                              * row.astype(xp.float32)[:, None])
    return out


def versions_at(params, update):
    """Each parameter's version after `update`: all new at 1, then a third each time."""
    return {p.index: max(k for k in range(1, update + 1) if k == 1 or p.index % 3 == k % 3)
            for p in params}


def model_config(args, overrides=""):
    m = dict(MODELS[args.model])
    for key in ("layers", "experts", "vocab"):
        if getattr(args, key):
            m[key] = getattr(args, key)
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        if key not in m or not value.isdigit():
            raise UsageError(f"--inference-config: '{item}' is not KEY=NUMBER with KEY one "
                             f"of {', '.join(m)}")
        m[key] = int(value)
    return m


def describe(m, params):
    count = sum(p.rows * p.cols for p in params)
    size = f"{count / 1e9:.2f} B" if count >= 1e7 else f"{count / 1e6:.2f} M"
    return (f"{m['layers']} layers, {m['experts']} experts, hidden {m['hidden']}, vocab "
            f"{m['vocab']}: {len(params)} tensors, {size} parameters, "
            f"{2 * count / 1e9:.2f} GB bf16")

"""The prompt chapter 18's prefiller runs, and its decoder runs again to check every byte:
a named model's shapes and KV pages (Shape), its layers' real matrix products run layer
by layer (Layers), and the time the prompt takes with no transfer at all (prefill_alone).
"""
import time

import numpy as np

from common.fabric import memory
from common.gpu.bf16 import gemm_bf16, to_bf16

# Qwen3-235B-A22B at TP4, one rank's shard: 94 layers, hidden 4096, 64 query heads and 4 KV
# heads of 128 (16 and 1 a rank), 8 of 128 experts of 1536 active (3072 a rank's worth).
MODELS = {
    "qwen3-235b-tp4": dict(layers=94, hidden=4096, q_dim=2048, kv_heads=1, head_dim=128,
                           ffn=3072),
    # the same layer, scaled down for a small machine's CPU (said in the output)
    "small": dict(layers=8, hidden=512, q_dim=256, kv_heads=1, head_dim=128, ffn=768),
}


class Shape:
    """A model's KV pages: each (layer, K or V, page) is page_tokens x kv_heads x head_dim
    bf16, one contiguous page; and the dtype its layers' matrix products run in."""

    def __init__(self, model, tokens, page_tokens, dtype="fp32"):
        self.__dict__.update(MODELS[model])
        self.model, self.tokens, self.page_tokens = model, tokens, page_tokens
        self.dtype = dtype
        self.pages = -(-tokens // page_tokens)      # pages a request needs, per (layer, K|V)
        self.page_bytes = page_tokens * self.kv_heads * self.head_dim * 2

    def page_set(self, layer, first, count, slots):
        """Page indices in a cache of `slots` pages per (layer, K|V): layer's K, then V."""
        return [(2 * layer + kv) * slots + first + p for kv in (0, 1) for p in range(count)]


def describe(s):
    return (f"{s.layers} layers, hidden {s.hidden}, {s.kv_heads} KV head(s) of {s.head_dim}, "
            f"{s.tokens} tokens, {s.page_tokens} a page, {s.dtype} products")


class Layers:
    """The prompt run layer by layer: seeded weights, real matrix products of the layer's
    size (projections and MLP; attention's scores left out), each layer's K and V laid out
    as KV pages. numpy on the host, cupy on a GPU; both sides compute the same bytes. In
    bf16 (a GPU only) the weights and each product's input are rounded to bf16, the rest
    (the residual, the activation) stays float32, as in a bf16 model's float32 epilogues."""

    def __init__(self, shape, seed, xp):
        self.s, self.xp, self.seed = shape, xp, seed
        self.bf16 = shape.dtype == "bf16"
        if self.bf16 and xp is np:
            raise ValueError("bf16 products need a GPU (--gpu)")
        rng = np.random.default_rng(seed)

        def weight(n, m):  # one set of weights for every layer: memory, not bytes, matters
            w = xp.asarray((rng.standard_normal((n, m)) / np.sqrt(n)).astype(np.float32))
            return to_bf16(w) if self.bf16 else w
        s = shape
        self.wq, self.wo = weight(s.hidden, s.q_dim), weight(s.q_dim, s.hidden)
        self.wk, self.wv = (weight(s.hidden, s.kv_heads * s.head_dim) for _ in range(2))
        self.w1, self.w2 = weight(s.hidden, s.ffn), weight(s.ffn, s.hidden)
        self.x = xp.asarray(rng.standard_normal((s.tokens, s.hidden)).astype(np.float32))

    def step(self, layer, out):
        """One layer: K and V (bf16) into out[2, pages, page bytes]; x moves on."""
        xp, s, x, mm, operand = self.xp, self.s, self.x, self.mm, self.operand
        pad = s.pages * s.page_tokens - s.tokens
        a = operand(x)
        for kv, w in enumerate((self.wk, self.wv)):
            rows = xp.pad(self.kv_bits(mm(a, w)), ((0, pad), (0, 0)))
            out[kv] = rows.reshape(s.pages, -1).view(xp.uint8)
        attended = mm(operand(mm(a, self.wq)), self.wo)
        hidden = mm(operand(xp.maximum(mm(operand(x + attended), self.w1), 0)), self.w2)
        self.x = (x + attended + hidden) / xp.float32(3.0)

    def operand(self, x):
        """A product's input: its bf16 bits (bf16), or the float32 as it is."""
        return to_bf16(x) if self.bf16 else x

    def mm(self, a, w):
        """a @ w in float32: bf16 on the tensor cores, or float32's own `@`."""
        return gemm_bf16(a, w) if self.bf16 else a @ w

    def kv_bits(self, y):
        """K or V as the pages hold it: bf16, rounded (bf16) or truncated (fp32)."""
        if self.bf16:
            return to_bf16(y)
        return (y.view(self.xp.uint32) >> 16).astype(self.xp.uint16)

    def context(self):
        """The last token's hidden state: what decoding starts from."""
        return self.x[-1:]


def prefill_alone(s, seed, xp, gpu):
    """The prompt's prefill without any transfer: time to first token, were it local (the
    second of two runs: the first pays for warming up the libraries and the memory)."""
    took = []
    for _ in range(2):
        layers, out = Layers(s, seed, xp), xp.empty((2, s.pages, s.page_bytes), xp.uint8)
        start = time.perf_counter()
        for layer in range(s.layers):
            layers.step(layer, out)
        memory.synchronize(gpu)
        took.append(time.perf_counter() - start)
    return took[-1]

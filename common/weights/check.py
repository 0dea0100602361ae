"""Chapter 19's check on an inference rank, after each update: every weight and scale, bit
for bit, against the plain quantisation of the whole tensor (common/gpu/rounding.py), and
the tensors whose bytes changed since the update before against those that should have.
"""
from common.gpu import rounding
from common.weights import BLOCK
from common.weights.model import checksum, values, views


class Check:
    """Of one inference rank's `weights` (its region, laid out as `tensors`) against the
    trainers' `params` as made from `seed` (numpy, or cupy on the GPU: `xp`). Calling it
    counts; it keeps each tensor's checksum for the next call."""

    def __init__(self, params, tensors, weights, xp, seed):
        self.names = {p.name: p for p in params}
        self.tensors, self.weights, self.xp, self.seed = tensors, weights, xp, seed
        self.sums = {}

    def __call__(self, versions, before):
        """Wrong bytes at `versions` (each parameter's), and the tensors changed against
        those expected to from `before` (the versions the last call checked)."""
        xp, wrong, changed, expected = self.xp, 0, 0, 0
        for tensor in self.tensors:
            data, scales = views(xp, self.weights, tensor)
            sources = [self.names[piece.source] for piece in tensor.pieces]
            for p, piece in zip(sources, tensor.pieces):
                x = values(xp, self.seed, p, versions[p.index], piece.row0, piece.row1)
                mine = data[piece.at_row:piece.at_row + piece.row1 - piece.row0]
                if not p.fp8:
                    wrong += 2 * int(xp.count_nonzero(mine != x))
                    continue
                codes, s = rounding.quantize_fp8(rounding.from_bf16(x), BLOCK)
                wrong += int(xp.count_nonzero(mine != codes[:, piece.col0:piece.col1]))
                b = piece.at_row // BLOCK
                theirs = s[:, piece.col0 // BLOCK:piece.col1 // BLOCK]
                wrong += 4 * int(xp.count_nonzero(scales[b:b + len(theirs)] != theirs))
            total = checksum(xp, self.weights[tensor.offset:tensor.end])
            changed += tensor.name in self.sums and self.sums[tensor.name] != total
            expected += tensor.name in self.sums and any(
                before.get(p.index) != versions[p.index] for p in sources)
            self.sums[tensor.name] = total
        return {"wrong": wrong, "changed": changed, "expected_changed": expected,
                "bytes": self.tensors[-1].end}

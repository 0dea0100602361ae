"""Chapter 19's weight update, what its file does not teach: the two sides' layouts
(model), a trainer's shards and staging (shards), where quantising runs (ops), the
inference side's bit-for-bit check (check), the naive baseline (naive), the report and
the stages' clock (report), and main() with its flags, the updates' schedule and the
ranks' exchanges (harness).

Both the chapter and the baseline name their WRITEs the same way: an immediate of the
update (8 bits) and the layer, or one of the kinds below, and WRITEs split at the
provider's largest message.
"""
from typing import NamedTuple

from common.gpu.rounding import FP8_BLOCK

BLOCK = FP8_BLOCK  # 128: weight blocks are 128 x 128, one float32 scale each

EDGES, BARRIER, GATHERED, BROADCAST, FREE = range(0xFFFF00, 0xFFFF05)  # immediates' kinds
LANDED = 1 << 23  # | layer + 1: an inference rank has that layer's bytes in its memory


def imm(update, kind):
    """The immediate of a WRITE: the update (8 bits) and its layer + 1 (or a kind above)."""
    return (update & 0xFF) << 24 | kind


class Write(NamedTuple):
    """One WRITE of `length` bytes: from `src` in the source's bytes of its kind (`what`:
    a job's "data" or "scales"), to `dst` in the destination region."""
    what: str
    src: int
    dst: int
    length: int


def split(what, dst, length, largest):
    """`length` bytes to dst on as [Write] of at most `largest` bytes each."""
    return [Write(what, at, dst + at, min(largest, length - at))
            for at in range(0, length, largest)]

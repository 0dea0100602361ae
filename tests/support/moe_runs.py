"""What the tests of chapters 16 and 17 share (tests/test_16_moe.py, tests/test_17_gpu_driven.py,
tests/test_16_17_moe_nics.py): the launcher, a small run, the lines that report its
checks, batches the all-to-all refuses, and the GPUs a launch spreads its ranks over."""
import re

from common.chapter_pair import ROOT

LAUNCH = str(ROOT / "scripts" / "launch.py")
TOKENS, TOPK = 6, 3
SMALL = ["--max-tokens", str(TOKENS), "--hidden", "128", "--experts", "16", "--topk", str(TOPK),
         "--private-tokens", "2"]
LIMIT = 120  # seconds for a whole launch, 8 ranks on 2 cores included


def check_lines(out):
    """{(dtype, case): (rows received, ranks that passed, of how many)} from rank 0's lines."""
    found = re.findall(r"^\[0\] check (\w+) (\S+) +private \d+: (\d+) \(token, expert\) rows "
                       r"received, counts exact and each row once(?: with its scales)? on "
                       r"(\d+) of (\d+) ranks; combine max \|error\| \S+ \(bf16 tolerance \S+\)$",
                       out, re.MULTILINE)
    return {(d, c): (int(n), int(ok), int(of)) for d, c, n, ok, of in found}


# (tokens, expert indices, what the refusal says) for an AllToAll of at most 4 tokens,
# 8 experts, top-2
BAD_BATCHES = [
    (5, [[0, 1]] * 5, "5 tokens, more than the maximum of 4"),
    (2, [[0, 8], [1, 2]], "expert index out of range 0..7"),
    (2, [[0, -1], [1, 2]], "expert index out of range 0..7"),
    (2, [[3, 3], [1, 2]], "a token names the same expert twice"),
    (2, [[0, 1, 2], [1, 2, 3]], "indices (2, 2)"),
    (2, [[0.0, 1.0], [1.0, 2.0]], "expert indices must be integers"),
]


def gpu_count():
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def gpus():
    return ",".join(str(g) for g in range(gpu_count()))

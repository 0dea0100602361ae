"""The transfer engine's ranks (tests/programs/transfer_ranks.py) started by scripts/launch.py, for
tests/test_transfer_engine.py and tests/test_transfer_cuda_ipc.py."""
import sys

from common.chapter_pair import ROOT, local_env
from tests.support.budget import Budget

LAUNCH = str(ROOT / "scripts" / "launch.py")
RANKS = str(ROOT / "tests" / "programs" / "transfer_ranks.py")
LIMIT = 180  # seconds for a whole launch, 8 tcp ranks on 2 busy cores included


def launched(ranks, *args, grace=10, timeout=10):
    """The ranks' waits (`timeout` for each transfer, a minute to meet) and the launcher's
    `grace`, all granted from one budget: each ends before the launch is stopped."""
    budget = Budget(LIMIT)
    return budget.run([sys.executable, LAUNCH, "-n", str(ranks), "--grace",
                       str(budget.grant(grace)), RANKS, *args, "--timeout",
                       str(budget.grant(timeout)), "--join", str(budget.grant(60))],
                      env=local_env(), cwd=ROOT)

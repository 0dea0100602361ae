"""Ctrl-C of a script a reader runs (the tour, the benchmarks), at a terminal or of the script
alone: one line, exit 130, within the bound, and nothing it started left running or in
/dev/shm. Every script ends so by construction: its main() runs under common/cli.run (its
process calls the provider, as a rank of transfer_bench does) or common/usage.run (it runs
chapters and tools as children and stops them), or it stops what it started its own way."""
import ast
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from common import shm_files
from common.bounds import STOP_BOUND
from common.chapter_pair import ROOT, local_env
from scripts.transfer_bench import nixl_env
from tests.support.budget import Budget
from tests.support.fabtests import rma_bw_missing
from tests.support.nixl_python import NIXL_PYTHON, WHY
from tests.support.processes import ctrl_c, running, wait_gone

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
OWN_WAY = {  # scripts that stop what they started themselves
    "launch.py": "common.launch.spawn passes the Ctrl-C on to every rank and says how they ended",
    "pair.py": "common.chapter_pair.run_pair stops both sides; it says so",
    "chaos.py": "it stops its trial's processes and says how far it got",
    "fuzz_connect.py": "its servers run under common.launch.owned, stopped on the way out; it says so",
}
LIMIT = 120  # seconds, quiet machine, for a script to reach the marked line on 2 busy cores


def runners(path):
    """The calls `cli.run(...)` and `usage.run(...)` under the script's `__main__` guard."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return {ast.unparse(call.func) for call in ast.walk(node)
                    if isinstance(call, ast.Call) and ast.unparse(call.func) in
                    ("cli.run", "usage.run")}
    return set()


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_script_ends_on_ctrl_c_in_one_line_by_construction(path):
    assert runners(path) or path.name in OWN_WAY, \
        f"{path.name}: its main() runs neither under cli.run nor usage.run"


def test_the_check_sees_a_script_whose_main_runs_bare(tmp_path):
    bare = tmp_path / "bare.py"
    bare.write_text('import sys\nif __name__ == "__main__":\n    sys.exit(main())\n')
    assert runners(bare) == set()
    bare.write_text('if __name__ == "__main__":\n    if x:\n        cli.run(main)\n')
    assert runners(bare) == {"cli.run"}


CASES = {  # the script's arguments, the line it prints once the part to cut into runs, and
    # its last words (a pattern): the tour then runs chapter 16's launcher and its 4 ranks
    "tour": (["scripts/tour.py"], "  09_multinet: ok", r"tour\.py: interrupted"),
    "transfer_bench": (["scripts/transfer_bench.py", "-p", "shm", "--no-fabtests",
                        "--repeats", "1000"], "route: ",
                       r"launch: the launcher was interrupted \(Ctrl-C\); all 2 ranks stopped "
                       r"[\d.]+ s later"),
    "baseline": (["scripts/baseline.py", "-p", "shm", "--sizes", "64K,1M"], "fi_rma_bw -o write",
                 r"baseline\.py: interrupted"),
    "nixl_pages": (["scripts/nixl_pages.py", "--page-size", "4K,64K", "--pages", "10000",
                    "--repeats", "200"], "page  pages", r"nixl_pages\.py: interrupted"),
    # in a copy of the repository: it writes each notebook it ran back in place
    "run_notebooks": (["scripts/run_notebooks.py"], "ran notebooks/07_queue.ipynb",
                      r"run_notebooks\.py: interrupted"),
}


def notebooks_copy(to):
    """What run_notebooks reads and writes, copied to `to` (the notebooks import common
    from the folder above theirs); returns `to`."""
    for part in ("common", "notebooks", "results", "scripts"):
        shutil.copytree(ROOT / part, to / part, ignore=shutil.ignore_patterns("runs"))
    return to


@pytest.mark.long
@pytest.mark.parametrize("whom", ["group", "script"])
@pytest.mark.parametrize("case", list(CASES))
def test_ctrl_c_of_a_script_is_one_line_and_leaves_nothing(case, whom, tmp_path):
    args, marker, last = CASES[case]
    root = notebooks_copy(tmp_path) if case == "run_notebooks" else ROOT
    if case == "baseline" and (why := rma_bw_missing()):
        pytest.skip(why)
    if case == "nixl_pages" and WHY:
        pytest.skip(WHY)
    python = NIXL_PYTHON if case == "nixl_pages" else sys.executable
    budget = Budget(3 * LIMIT)
    token = uuid.uuid4().hex  # in the environment of everything the script starts
    env = local_env({"CTRL_C_TEST": token,  # and this repository on the path of NIXL's python
                     "PYTHONPATH": nixl_env()["PYTHONPATH"]})
    proc = subprocess.Popen([python, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=root, env=env, start_new_session=True)
    mine = f"CTRL_C_TEST={token}".encode()
    try:
        lines, deadline = [], time.monotonic() + budget.grant(LIMIT)
        while not any(marker in line for line in lines):
            assert time.monotonic() < deadline, f"no '{marker}' within the limit: {lines}"
            if select.select([proc.stdout], [], [], 0.1)[0]:
                lines.append(proc.stdout.readline())
                assert lines[-1], f"it ended before '{marker}': {lines}"
        started = running(mine)
        out, err, elapsed = ctrl_c(proc, whom, budget)
        left = wait_gone(mine, budget.grant(STOP_BOUND))
    finally:
        proc.kill()
        for pid in running(mine):
            os.kill(pid, signal.SIGKILL)
    said = "".join(lines) + out + err
    assert proc.returncode == 130 and "Traceback" not in said, said
    assert re.fullmatch(last, err.splitlines()[-1]), err
    assert elapsed < STOP_BOUND + budget.grant(1), elapsed
    assert not left, f"still running: {left}"
    regions = shm_files.remove_left_by(started)  # removed, so that a failure leaves nothing
    assert not regions, f"left in /dev/shm: {sorted(regions)}"

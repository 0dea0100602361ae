"""scripts/pair.py: each side's lines as they come, named; what each side ran, its path as
the reader types it; Ctrl-C of pair.py (at a terminal, or of pair.py alone) stops both
sides within its bound; a client killed with SIGKILL leaves nothing in /dev/shm."""
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from common import shm_files
from common.chapter_pair import INTERRUPTED_WAIT, ROOT, local_env
from tests.support.budget import Budget
from tests.support.processes import alive, ctrl_c, kill_job

PAIR = str(ROOT / "scripts" / "pair.py")
LIMIT = 60  # seconds, quiet machine, for chapter 07's server and client to start on 2 busy cores
STARTED_AND_STOPPED = 2 * LIMIT  # a test starts them, then waits LIMIT for pair.py's end


@pytest.mark.long
@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_each_side_is_named_by_the_path_the_reader_types(where, tmp_path):
    """From the repository's root, chapters/04_hello.py; from a folder outside it, the
    absolute path, which is what works there."""
    cwd = ROOT if where == "root" else tmp_path
    done = Budget(LIMIT).run([sys.executable, PAIR, "04", "-p", "shm"], env=local_env(),
                             cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    path = "chapters/04_hello.py" if where == "root" else str(ROOT / "chapters" / "04_hello.py")
    server, client = done.stdout.splitlines()[-2:]
    assert server == f"--- server: {path} -p shm -> exit 0", done.stdout
    assert re.fullmatch(rf"--- client 1: {re.escape(path)} -p shm [0-9a-f]+ -> exit 0", client), \
        done.stdout


def start_07(budget):
    """pair.py on chapter 07 (its client runs for long), in a session of its own as a shell
    starts a job; returns it once the client has said something (within LIMIT seconds of
    `budget`), and both sides' pids."""
    proc = subprocess.Popen([sys.executable, PAIR, "07", "-p", "shm"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=local_env(), cwd=ROOT,
                            start_new_session=True)
    within = budget.grant(LIMIT)
    lines, deadline = [], time.monotonic() + within
    while not any(line.startswith("client 1: ") for line in lines):
        assert time.monotonic() < deadline, f"nothing from the client within {within:.0f} s"
        if select.select([proc.stdout], [], [], 0.1)[0]:
            lines.append(proc.stdout.readline())
            assert lines[-1], f"the client said nothing while it ran: {lines}"
    assert lines[0].startswith("server: "), lines
    return proc, children(proc.pid)


def children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def assert_nothing_left(pids):
    assert not [p for p in pids if alive(p)], "a side outlived pair.py"
    left = shm_files.remove_left_by(pids)  # removed, so that a failure here leaves nothing
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.mark.long
@pytest.mark.parametrize("whom", ["group", "pair"])
def test_ctrl_c_stops_both_sides_at_once(whom):
    budget = Budget(STARTED_AND_STOPPED)
    proc, sides = start_07(budget)
    try:
        assert len(sides) == 2, sides
        out, err, elapsed = ctrl_c(proc, whom, budget)
    finally:
        kill_job(proc, sides)
    assert proc.returncode == 130 and "Traceback" not in out + err, out + err
    assert err.splitlines()[-1] == "pair: interrupted; server and clients stopped"
    # each side closes within INTERRUPTED_WAIT or is killed (a busy machine)
    for side in ("server", "client 1"):
        assert f"{side}: 07_queue.py: interrupted, resources closed" in err \
            or f"{side}: killed: not closed within" in err, err
    assert elapsed < INTERRUPTED_WAIT + budget.grant(1), elapsed
    assert_nothing_left(sides)


@pytest.mark.long
def test_a_killed_client_leaves_nothing():
    """A client killed by SIGKILL removes nothing itself: pair.py removes its shm region."""
    budget = Budget(STARTED_AND_STOPPED)
    proc, sides = start_07(budget)
    try:
        server, client = sides
        os.kill(client, signal.SIGKILL)
        out, err = budget.communicate(proc)
    finally:
        kill_job(proc, sides)
    assert proc.returncode == 1 and "Traceback" not in out + err, out + err
    assert f"-> exit {-signal.SIGKILL}" in out.splitlines()[-1], out
    assert_nothing_left(sides)

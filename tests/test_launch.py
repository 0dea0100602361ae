"""scripts/launch.py owns its ranks: Ctrl-C (at a terminal, or of the launcher alone), a
launcher killed, a frozen rank or a Ctrl-C while it still spawns all end every rank within
a stated bound, and nothing is left in /dev/shm."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from common import shm_files
from common.launch import KILL_WAIT
from scripts.pair import ROOT, chapter_path, local_env
from tests.budget import Budget
from tests.processes import alive
from tests.test_bad_input import assert_one_line_error

LAUNCH = str(ROOT / "scripts" / "launch.py")
# The benchmark at its own (decode) shape: numpy holds a rank for milliseconds at a time,
# so signals that come close together are all pending when it looks
MOE = [str(chapter_path(16)), "-p", "shm", "--iters", "1000000", "--check"]
SLEEPER = "import time\ntime.sleep(600)\n"  # a rank that never looks at the rendezvous
LIMIT = 120  # seconds, quiet machine, for 4 ranks to start on a busy 2-core machine
STARTED_AND_STOPPED = 2 * LIMIT  # a test that starts ranks, then waits LIMIT for their end


def start(budget, *args, grace=10):
    """The launcher in a session of its own (as a shell starts a job): its process group
    is what a terminal's Ctrl-C reaches. Returns it and its ranks' pids, once they are in
    the benchmark loop (within LIMIT seconds of `budget`)."""
    proc = subprocess.Popen([sys.executable, LAUNCH, "--grace", str(grace), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=local_env(), cwd=ROOT, start_new_session=True)
    pids = [int(p) for p in re.search(r"pids ([\d ]+)$", proc.stderr.readline())[1].split()]
    deadline = time.monotonic() + budget.grant(LIMIT)
    while "benchmark" not in proc.stdout.readline():
        assert time.monotonic() < deadline and proc.poll() is None
    return proc, pids


def assert_all_gone(pids, within):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)], "ranks outlived the launcher"
    left = shm_files.remove_left_by(pids)  # removed, so that a failure here leaves nothing
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.mark.parametrize("whom", ["group", "launcher"])
def test_ctrl_c_closes_every_rank(whom):
    """At a terminal Ctrl-C reaches the launcher and its ranks at once; passed on again by
    the launcher, a second signal cut into the ranks' clean-up and left each one's shm
    region (16 MiB) behind, though each said 'resources closed'. (A check first: a rank's
    first endpoint installs shm's own signal handler, which removes the regions, until the
    next fi_getinfo takes the signals back; common/fabric/__init__.py.)"""
    budget = Budget(STARTED_AND_STOPPED)
    proc, pids = start(budget, "-n", "4", "--ranks-per-node", "2", *MOE, "random")
    time.sleep(1)  # past the first barrier, into the rounds (where the regions were left)
    try:
        if whom == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGINT)
        _, err = budget.communicate(proc)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "launch: the launcher was interrupted (Ctrl-C); all 4 ranks stopped" in err
    for rank in range(4):
        assert f"[{rank}] 16_moe.py: interrupted, resources closed" in err, err
    assert_all_gone(pids, 0)


@pytest.mark.parametrize("program", ["chapter", "sleeper"])
def test_ranks_die_with_a_killed_launcher(program, tmp_path):
    """SIGKILL leaves the launcher no word to say: the kernel tells its ranks (SIGTERM, set
    by prctl in each), which close what they opened, whether or not they would have seen
    the rendezvous close."""
    budget = Budget(STARTED_AND_STOPPED)
    if program == "chapter":
        proc, pids = start(budget, "-n", "2", "--ranks-per-node", "1", *MOE, "none")
    else:
        (tmp_path / "sleeper.py").write_text(SLEEPER)
        proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "2", str(tmp_path / "sleeper.py")],
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        pids = [int(p) for p in re.search(r"pids ([\d ]+)$", proc.stderr.readline())[1].split()]
    try:
        proc.kill()
        proc.wait()
        assert_all_gone(pids, budget.grant(10))
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_frozen_rank_does_not_hold_the_launcher():
    """A rank stopped by SIGSTOP acts on no signal until SIGCONT: the launcher sends one
    after each, and SIGKILL (which acts on it anyway) bounds the rest."""
    grace, budget = 1, Budget(STARTED_AND_STOPPED)
    proc, pids = start(budget, "-n", "2", *MOE, "none", grace=grace)
    try:
        os.kill(pids[1], signal.SIGSTOP)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = budget.communicate(proc)
        elapsed = time.monotonic() - signalled
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert elapsed < budget.grant(grace + KILL_WAIT + 5), elapsed
    assert_all_gone(pids, 0)


# Spawns like the launcher, but Ctrl-C lands while the third rank is being started.
SPAWN_INTERRUPTED = textwrap.dedent("""
    import os, signal, subprocess, sys
    from common import launch
    real, started = subprocess.Popen, []
    def popen(*args, **kwargs):
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        started.append(real(*args, **kwargs))
        print("rank pid", started[-1].pid, file=sys.stderr, flush=True)
        return started[-1]
    subprocess.Popen = popen
    sys.exit(launch.spawn(["-c", "import time; time.sleep(600)"], 40))
""")


def test_ctrl_c_while_spawning_stops_what_was_started():
    done = Budget(LIMIT).run([sys.executable, "-c", SPAWN_INTERRUPTED], cwd=ROOT,
                             env=local_env())
    pids = [int(p) for p in re.findall(r"^rank pid (\d+)$", done.stderr, re.MULTILINE)]
    ours = "".join(line for line in done.stderr.splitlines(True) if not line.startswith("["))
    assert done.returncode == 130 and "Traceback" not in ours, done.stderr  # a rank's may be
    assert len(pids) < 40
    assert "launch: the launcher was interrupted (Ctrl-C); the " in done.stderr
    assert_all_gone(pids, 0)


@pytest.mark.parametrize("args,pattern", [
    (["-n", "0", "x.py"], "-n must be at least 1, got 0"),
    (["-n", "1000", "x.py"], "-n 1000: at most 128 ranks on one host"),
    (["-n", "2", "--ranks-per-node", "0", "x.py"], "--ranks-per-node (0) must divide"),
    (["-n", "2", "--grace", "-1", "x.py"], "--grace must be 0 to 600 seconds"),
])
def test_bad_world_is_one_line(args, pattern):
    done = Budget(LIMIT).run([sys.executable, LAUNCH, *args], env=local_env(), cwd=ROOT)
    assert_one_line_error(done, pattern)

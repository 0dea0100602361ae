"""scripts/launch.py owns its ranks: Ctrl-C (at a terminal, or of the launcher alone), a
launcher killed, a frozen rank or a Ctrl-C while it still spawns all end every rank within
a stated bound, and nothing is left in /dev/shm."""
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from common import launch, shm_files
from common.launch import KILL_WAIT
from common.chapter_pair import ROOT, chapter_path, local_env
from tests.support.budget import Budget
from tests.support.processes import alive, kill_job
from tests.support.one_line_errors import assert_one_line_error

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


@pytest.mark.long
@pytest.mark.parametrize("whom", ["group", "launcher"])
def test_ctrl_c_closes_every_rank(whom):
    """At a terminal Ctrl-C reaches the launcher and its ranks at once; passed on again by
    the launcher, a second signal cut into the ranks' clean-up and left each one's shm
    region (16 MiB) behind, though each said 'resources closed'. (A check first: a rank's
    first endpoint installs shm's own signal handler, which removes the regions, until the
    next fi_getinfo takes the signals back; common/fabric/binding.py.)"""
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


@pytest.mark.long
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


# A rank that waits at the rendezvous as a chapter does between its steps: a gather may
# take long (60 s), a rank may be silent only SILENCE s (its --timeout). Rank 1 stops itself
# (SIGSTOP) at its start, before it joins, or once it joined.
MEETER = textwrap.dedent("""
    import common
    import os, signal, sys
    from common import cli, launch
    def main():
        place = launch.place_from_environment()
        if place.rank == 1 and sys.argv[1] == "start":
            os.kill(os.getpid(), signal.SIGSTOP)
        with launch.Group(place, 60, float(sys.argv[2])) as group:
            if place.rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            group.barrier()
    cli.run(main)
""")
SILENCE = 2


def stopped(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


@pytest.mark.long
@pytest.mark.parametrize("when", ["start", "joined"])
def test_a_frozen_rank_stops_the_job_once_silent_for_its_timeout(when, tmp_path):
    """A frozen rank closes no connection: the rendezvous takes one silent for as long as
    the ranks may be (their --timeout) for gone, even before it joined (its process is
    stopped), and the others end within that + 5 s, not when their gather would (60 s)."""
    grace, budget = 1, Budget(LIMIT)
    (tmp_path / "meeter.py").write_text(MEETER)
    proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "3", "--grace", str(grace),
                             str(tmp_path / "meeter.py"), when, str(SILENCE)],
                            stderr=subprocess.PIPE, text=True, env=local_env(), cwd=ROOT)
    try:
        pids = [int(p) for p in re.search(r"pids ([\d ]+)$", proc.stderr.readline())[1].split()]
        while not stopped(pids[1]):
            assert time.monotonic() < budget.deadline and proc.poll() is None
            time.sleep(0.02)
        frozen = time.monotonic()
        ends = {}
        while len(ends) < 2:
            for rank in (0, 2):
                if rank not in ends and not alive(pids[rank]):
                    ends[rank] = time.monotonic() - frozen
            assert time.monotonic() < budget.deadline
            time.sleep(0.02)
        _, err = budget.communicate(proc)
        elapsed = time.monotonic() - frozen
    finally:
        kill_job(proc, pids)
    silent = f"rank 1 gave no sign of life for {SILENCE} s (frozen, or its host is gone)"
    assert proc.returncode == 1 and "Traceback" not in err, err
    for rank in (0, 2):
        assert f"[{rank}] meeter.py: error: stopping: {silent}\n" in err, err
        assert ends[rank] < budget.grant(SILENCE + 5), ends
    assert f"launch: {silent}; all 3 ranks stopped" in err, err
    assert elapsed < budget.grant(SILENCE + 5 + grace + KILL_WAIT), elapsed
    assert_all_gone(pids, 0)


@pytest.mark.long
def test_a_frozen_rendezvous_is_seen_by_the_ranks():
    """A rendezvous that welcomed a rank and then went silent (its host, rank 0 or the
    launcher, frozen) ends the rank's gather once silent for the rank's --timeout."""
    budget = Budget(LIMIT)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        place = launch.Place(0, 2, 2, None, listener.getsockname(), False, "test")
        def welcome():
            conn, _ = listener.accept()
            conn.recv(launch.FRAME.size + launch.HELLO.size)
            conn.sendall(launch.FRAME.pack(1, launch.WELCOME) + b"x")
            return conn
        kept = []
        server = threading.Thread(target=lambda: kept.append(welcome()))
        server.start()
        start = time.monotonic()
        with pytest.raises(launch.PeerGone, match=f"the rendezvous gave no sign of life for "
                                                   f"{SILENCE} s \\(its host, rank 0 or the "
                                                   "launcher, is frozen or gone\\)"):
            launch.Group(place, budget.grant(60), SILENCE)
        assert time.monotonic() - start < budget.grant(SILENCE + 5)
        server.join()
        kept[0].close()


def joined(world, budget, silence=None):
    """A RendezvousServer of `world` ranks, each joined in this process: (server, groups)."""
    server = launch.RendezvousServer(world, world, join_timeout=budget.grant(60))
    groups = {}
    def join(rank):
        place = launch.Place(rank, world, world, None, server.address, False, "test")
        groups[rank] = launch.Group(place, budget.grant(60), silence)
    joiners = [threading.Thread(target=join, args=(rank,)) for rank in range(world)]
    for thread in joiners:
        thread.start()
    for thread in joiners:
        thread.join(budget.left())
    return server, groups


@pytest.mark.long
def test_a_gather_that_runs_out_names_the_ranks_that_did_not_come():
    """A rank that lives but is not at the gather (busy, or frozen just after its last sign
    of life, so not yet silent for long enough): the gather that runs out names it, not
    'every rank', and the job stops in the same words for the others."""
    budget = Budget(LIMIT)
    server, groups = joined(3, budget)
    stopped = []
    def wait_at_the_gather():
        with pytest.raises(launch.PeerGone) as raised:
            groups[2].allgather(b"2", budget.grant(60))
        stopped.append(str(raised.value))
    waiter = threading.Thread(target=wait_at_the_gather)
    try:
        waiter.start()
        while 2 not in server.gathered:  # rank 2 is at the gather before rank 0 runs out
            assert time.monotonic() < budget.deadline
            time.sleep(0.01)
        with pytest.raises(TimeoutError, match=r"^no allgather from rank 1 within 0.5 s$"):
            groups[0].allgather(b"0", 0.5)
        waiter.join(budget.left())
        assert stopped == ["stopping: no allgather from rank 1 within 0.5 s"]
        assert server.failure == "no allgather from rank 1 within 0.5 s"
    finally:
        for group in groups.values():
            group.close()
        waiter.join(budget.left())
        server.join(budget.left())
    assert not server.is_alive()


@pytest.mark.long
@pytest.mark.parametrize("frozen", [True, False], ids=["frozen", "alive"])
def test_beats_read_late_count_from_when_they_were_sent(frozen, monkeypatch):
    """A rank computes for longer than the silence, not looking, its beats left unread.
    If the rendezvous froze meanwhile, the rank's next gather ends at once: the beats carry
    the rendezvous's clock (before, it waited one more silence from reading them:
    scripts/chaos.py, chapter 19). If it lives, the gather reads every beat that waits
    before it judges the silence, and runs its course (here, out of time for rank 1)."""
    budget = Budget(LIMIT)
    server, groups = joined(2, budget, SILENCE)
    try:
        until = time.monotonic() + 1.0
        while time.monotonic() < until:  # a wait loop's looks: the beats read as they come
            groups[0].check()
            time.sleep(0.01)
        if frozen:
            monkeypatch.setattr(server, "_say_alive", lambda: None)
        time.sleep(SILENCE + 0.5)  # rank 0 computes
        started = time.monotonic()
        if frozen:
            with pytest.raises(launch.PeerGone, match="the rendezvous gave no sign of life"):
                groups[0].barrier(budget.grant(60))
            took = time.monotonic() - started  # before: SILENCE, counted from the reading
            assert took < SILENCE / 2, f"the gather took {took:.1f} s to see the silence"
        else:
            with pytest.raises(TimeoutError, match=r"^no allgather from rank 1 within 1 s$"):
                groups[0].barrier(1)
    finally:
        monkeypatch.undo()
        for group in groups.values():
            group.close()
        server.join(budget.left())


# A rank that leaves a child holding its output: the launcher, its ranks ended, still reads
# what they wrote (a second for each stream) when SIGTERM comes.
LINGERER = "import subprocess\nprint(subprocess.Popen(['sleep', '30']).pid, flush=True)\n"


@pytest.mark.long
def test_sigterm_as_the_ranks_end_is_said_by_the_launcher(tmp_path):
    budget = Budget(LIMIT)
    (tmp_path / "lingerer.py").write_text(LINGERER)
    proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "2", str(tmp_path / "lingerer.py")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=local_env(), cwd=ROOT)
    children = []
    try:
        pids = [int(p) for p in re.search(r"pids ([\d ]+)$", proc.stderr.readline())[1].split()]
        children = [int(proc.stdout.readline().split()[1]) for _ in pids]
        while any(alive(p) for p in pids):
            assert time.monotonic() < budget.deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = budget.communicate(proc)
    finally:
        proc.kill()
        for child in children:
            os.kill(child, signal.SIGKILL)
    assert proc.returncode == 143, (proc.returncode, err)
    line, = err.strip().splitlines()
    assert line.startswith("launch: the launcher got SIGTERM; all 2 ranks stopped"), line


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

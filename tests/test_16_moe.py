"""Chapter 16 on --device cpu: every case against the reference, on 2, 4 and 8 ranks,
one and two emulated nodes; bad input; a rank killed mid-run."""
import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import common.fabric as fi
from common import launch
from common.moe import harness
from common.moe import reference as ref
from common.chapter_pair import ROOT, chapter_module, chapter_path, local_env
from tests.support.budget import Budget
from tests.support.gpu import needs_gpu
from tests.support.moe_runs import (BAD_BATCHES, LAUNCH, LIMIT, SMALL, TOKENS, TOPK, check_lines,
                                    gpus)
from tests.support.one_line_errors import assert_one_line_error, run
from tests.support.processes import kill_job

CHAPTER = str(chapter_path(16))


def launched(ranks, per_node, *args, provider=None):
    command = [sys.executable, LAUNCH, "-n", str(ranks), "--ranks-per-node", str(per_node),
               CHAPTER, *(["-p", provider] if provider else []), *args]
    return Budget(LIMIT).run(command, env=local_env(), cwd=ROOT)


@pytest.mark.parametrize("ranks,per_node,provider", [
    (2, 2, None), *(pytest.param(*case, marks=pytest.mark.long) for case in [
        (2, 1, "shm"), (4, 4, None), (4, 2, "tcp"), (8, 8, None), (8, 4, "shm")])],
    ids=["2-one-node", "2-two-nodes-shm", "4-one-node", "4-two-nodes-tcp", "8-one-node",
         "8-two-nodes-shm"])
def test_every_case_matches_the_reference(ranks, per_node, provider):
    done = launched(ranks, per_node, *SMALL, "--iters", "0", provider=provider)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = check_lines(done.stdout)
    assert set(lines) == {(d, c) for d in ("fp8", "bf16") for c in ref.CASES}, done.stdout
    for (dtype, case), (rows, ok, of) in lines.items():
        assert ok == of == ranks, (dtype, case)
        every = ranks * TOKENS * TOPK  # each token's 3 experts are distinct: 3 rows each
        if case in ("random", "empty-expert", "one-expert", "overflow"):
            assert rows == every, (dtype, case)
        if case == "silent-rank":
            assert rows == every - TOKENS * TOPK, (dtype, case)
        if case == "fewer":
            assert rows < every, (dtype, case)
    assert re.search(r"^\[0\] all checks passed \(seed \d+\)$", done.stdout, re.MULTILINE)
    nodes = ranks // per_node
    assert (f"{nodes} emulated nodes of {per_node}" if nodes > 1 else "one node") in done.stdout


@pytest.mark.long
def test_benchmark_reports_each_half_and_bandwidth():
    done = launched(2, 1, *SMALL, "--check", "none", "--iters", "3", "--warmup", "1",
                    provider="shm")
    assert done.returncode == 0, done.stdout + done.stderr
    for half in ("dispatch send", "dispatch recv", "combine send", "combine recv"):
        assert re.search(rf"^\[0\]   {half} +p50 +[\d.]+ us   max +[\d.]+ us$", done.stdout,
                         re.MULTILINE), half
    row = 128 + 128 // 128 * 4
    assert re.search(rf"dispatch +p50 .* [\d.]+ GB/s \({TOKENS * TOPK} rows x {row} B / p50\)",
                     done.stdout)
    assert re.search(rf"combine +p50 .* [\d.]+ GB/s \({TOKENS * TOPK} rows x 256 B / p50\)",
                     done.stdout)
    assert "[0] provider: shm" in done.stdout


@pytest.mark.long
def test_benchmark_sweeps_tokens_into_json(tmp_path):
    path = tmp_path / "moe.json"
    done = launched(2, 2, *SMALL, "--check", "none", "--iters", "2", "--warmup", "0",
                    "--tokens", "0,2,6", "--json", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(path.read_text())
    assert (data["chapter"], data["device"], data["world"]) == ("16_moe", "cpu", 2)
    assert [r["tokens"] for r in data["runs"]] == [0, 2, 6]
    for row in data["runs"]:
        assert row["implementation"] == "ours" and row["rows"] == row["tokens"] * TOPK
        assert row["dispatch_bytes"] == row["rows"] * (128 + 4)
        assert row["combine_bytes"] == row["rows"] * 256
        for phase in ("dispatch_send", "dispatch_recv", "dispatch", "combine_send",
                      "combine_recv", "combine"):
            assert 0 < row[f"{phase}_p50_us"] <= row[f"{phase}_max_us"]


@pytest.mark.long
@pytest.mark.parametrize("per_node", [4, 2], ids=["one-node", "two-nodes"])
def test_a_rank_killed_mid_run_stops_the_others(per_node):
    proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "4", "--ranks-per-node", str(per_node),
                             CHAPTER, "-p", "shm", *SMALL, "--check", "none", "--iters",
                             "1000000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=local_env(), cwd=ROOT)
    try:
        pids = re.search(r"pids ([\d ]+)$", proc.stderr.readline())
        assert pids, "the launcher names its ranks' pids"
        budget = Budget(LIMIT)
        while "benchmark" not in proc.stdout.readline():  # the ranks are in the loop
            assert budget.left() > 0
        victim = int(pids[1].split()[1])
        killed = time.monotonic()
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        out, err = proc.communicate(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert elapsed < 15, f"the others took {elapsed:.1f} s to stop"
    assert "launch: rank 1 was killed by SIGKILL; all 4 ranks stopped" in err
    for rank in (0, 2, 3):
        assert re.search(rf"^\[{rank}\] 16_moe.py: error: stopping: rank 1 "
                         r"(is gone|was killed by SIGKILL)", err, re.MULTILINE), err
    assert "Traceback" not in err


@pytest.mark.parametrize("args,pattern", [
    (["--tokens", "9", "--max-tokens", "8"], "--tokens 9: more than --max-tokens 8"),
    (["--topk", "9", "--experts", "8"], "top-k (9) must be 1..8"),
    (["--hidden", "100"], "fp8 needs hidden (100) to be a multiple of 128"),
    (["--check", "random,bogus"], "unknown case(s) bogus"),
    (["--world", "2"], "--world 2, but this job has 1 rank (no launcher: one rank)"),
    (["--device", "gpu"], "invalid choice: 'gpu'"),
    (["--baseline", "nccl"], "unrecognized arguments: --baseline nccl"),  # chapter 17's
    (["-p", "nosuch"], "unknown provider 'nosuch'"),
    (["--tokens", "1,x"], "--tokens takes numbers like 1,8,128"),
    (["--tokens", "4,200"], "--tokens 200: more than --max-tokens 128"),
    pytest.param(["--device", "cuda", "--max-tokens", "4", "--hidden", "128"],
                 "GPU memory needs cupy", marks=pytest.mark.skipif(
                     importlib.util.find_spec("cupy") is not None, reason="cupy is here")),
])
def test_bad_input_is_one_line(args, pattern):
    done, _ = run(16, *args)
    assert_one_line_error(done, pattern)


@pytest.mark.long
def test_world_size_not_matching_the_launcher():
    done = launched(2, 2, *SMALL, "--world", "4")
    assert done.returncode == 2
    assert "[0] 16_moe.py: error: --world 4, but this job has 2 ranks (scripts/launch.py)" \
        in done.stderr
    assert "launch: rank" in done.stderr and "exited with code 2" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.long
def test_experts_that_do_not_split_over_the_ranks():
    done = launched(3, 3, *SMALL)
    assert done.returncode == 2
    assert "error: 16 experts do not split evenly over 3 ranks" in done.stderr
    assert "Traceback" not in done.stderr


# --- the API, in this process (one rank) -------------------------------------------------

@pytest.fixture
def one_rank():
    moe = chapter_module(16)
    group = launch.Group(launch.Place(0, 1, 1, None, None, False, "test"))
    with fi.Closer() as own:
        yield moe, moe.AllToAll(own, group, max_tokens=4, experts=8, topk=2, hidden=128)


@pytest.mark.parametrize("tokens,indices,pattern", BAD_BATCHES)
def test_bad_batches_are_refused_before_anything_moves(one_rank, tokens, indices, pattern):
    moe, a2a = one_rank
    x = np.ones((tokens, 128), np.float32)
    with pytest.raises(ValueError, match=re.escape(pattern)):
        a2a.dispatch_send(x, np.array(indices))
    assert a2a.stage == "idle" and a2a.round == 0  # nothing was sent: a good batch still goes
    a2a.dispatch_send(np.ones((1, 128), np.float32), np.array([[0, 5]]))
    tokens_out, scales, counts = a2a.dispatch_recv()
    assert counts.tolist() == [1, 0, 0, 0, 0, 1, 0, 0] and tokens_out.shape == (2, 128)


def test_halves_out_of_order_are_refused(one_rank):
    moe, a2a = one_rank
    with pytest.raises(ValueError, match="out of order"):
        a2a.dispatch_recv()
    with pytest.raises(ValueError, match="out of order"):
        a2a.combine_recv(np.ones((0, 2), np.float32))


def test_wrong_combine_shapes_are_refused_and_the_round_goes_on(one_rank):
    moe, a2a = one_rank
    a2a.dispatch_send(np.ones((2, 128), np.float32), np.array([[0, 5], [1, 5]]))
    tokens, _, _ = a2a.dispatch_recv()
    with pytest.raises(ValueError, match=r"expert outputs must be \(4, 128\)"):
        a2a.combine_send(np.ones((3, 128), np.float32))
    a2a.combine_send(np.ones((4, 128), np.float32))
    with pytest.raises(ValueError, match=r"weights must be \(2, 2\)"):
        a2a.combine_recv(np.ones((2, 3), np.float32))
    out = a2a.combine_recv(np.full((2, 2), 0.5, np.float32))
    assert np.array_equal(out, np.ones((2, 128), np.float32))  # 0.5 * 1 + 0.5 * 1


@pytest.mark.parametrize("shape,pattern", [
    (dict(experts=8, topk=9), "top-k (9) must be 1..8"),
    (dict(experts=0, topk=1), "0 experts do not split evenly"),
    (dict(experts=8, topk=2, hidden=100), "multiple of 128"),
    (dict(experts=8, topk=2, dispatch_dtype="fp16"), "fp8 or bf16"),
    (dict(experts=8, topk=2, combine_dtype="fp8"), "combine dtype must be bf16, not 'fp8'"),
])
def test_bad_shapes_are_refused(shape, pattern):
    moe = chapter_module(16)
    group = launch.Group(launch.Place(0, 1, 1, None, None, False, "test"))
    with fi.Closer() as own, pytest.raises(ValueError, match=re.escape(pattern)):
        moe.AllToAll(own, group, max_tokens=4, **{"hidden": 128, **shape})


# --- the launcher's environment modes ------------------------------------------------------

def test_kernel_arguments_take_the_bits_the_driver_reads():
    # cuLaunchKernel reads 4 bytes of an int's slot, 8 of a pointer's (little-endian)
    from common.gpu.kernel_call import _word

    class Device:  # what a cupy array offers: .data.ptr
        class data:
            ptr = 0x7F00_0000_1000
    assert _word(Device()) == 0x7F00_0000_1000
    assert _word(np.int32(-1)) & 0xFFFF_FFFF == 0xFFFF_FFFF
    assert _word(-2) == 2**64 - 2 and _word(np.uint32(7)) == 7
    assert _word(np.uintp(2**63)) == 2**63


def test_no_cuda_driver_is_one_line():
    # a ValueError, which cli.run says in one line, not an OSError's traceback
    import ctypes
    from common.gpu.kernel_call import KernelCall
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("a CUDA driver is here: this is for a machine without one")

    class Null:
        ptr = 0
    Null.kernel = Null
    with pytest.raises(ValueError, match="cannot load the CUDA driver"):
        KernelCall(Null, Null, 32, n=1)


def test_place_from_torchrun_slurm_and_nothing():
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    p = launch.place_from_environment(torchrun)
    assert (p.rank, p.world, p.node, p.nodes, p.rendezvous, p.serve) == \
        (5, 8, 1, 2, ("10.0.0.1", 29501), False)
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_NTASKS_PER_NODE": "8",
             "MASTER_ADDR": "node1", "MASTER_PORT": "1234"}
    p = launch.place_from_environment(slurm)
    assert (p.rank, p.world, p.nodes, p.serve, p.source) == (0, 16, 2, True, "Slurm variables")
    assert launch.place_from_environment({}).world == 1
    with pytest.raises(ValueError, match="no MASTER_ADDR and MASTER_PORT"):
        launch.place_from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    with pytest.raises(ValueError, match="does not make sense"):
        launch.place_from_environment({**torchrun, "RANK": "8"})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.long
@pytest.mark.parametrize("launcher", ["torchrun", "Slurm"])
def test_ranks_meet_without_our_launcher(launcher):
    port = free_port() - 1  # the rendezvous is served on MASTER_PORT + 1

    def env(rank):
        where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if launcher == "torchrun":
            return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": "2", **where}
        return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank),
                "SLURM_NTASKS_PER_NODE": "2", **where}
    procs = [subprocess.Popen(
        [sys.executable, CHAPTER, *SMALL, "--check", "random", "--iters", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=local_env(env(r))) for r in range(2)]
    try:
        budget = Budget(LIMIT)
        results = [budget.communicate(p) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], results
    assert f"2 ranks ({launcher} variables), one node" in results[0][0]
    assert "check bf16 random" in results[0][0] and "on 2 of 2 ranks" in results[0][0]


def test_a_rank_of_another_world_is_turned_away():
    server = launch.RendezvousServer(world=2, ranks_per_node=2)
    place = launch.Place(0, 3, 3, None, server.address, False, "test")
    with pytest.raises(launch.PeerGone, match="rank 0 expects 3 ranks, 3 per node; this job "
                                              "has 2, 2 per node"):
        launch.Group(place, timeout=5)


@pytest.mark.long
def test_launcher_passes_ctrl_c_on():
    """Ctrl-C on the launcher stops every rank, which close what they opened."""
    proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "2", CHAPTER, *SMALL, "--check",
                             "none", "--iters", "1000000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=local_env(), cwd=ROOT)
    try:
        while "benchmark" not in proc.stdout.readline():
            pass
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err
    assert "launch: the launcher was interrupted (Ctrl-C); all 2 ranks stopped" in err


@pytest.mark.long
def test_tiny_provider_queues_make_the_proxy_wait_not_fail():
    """Provider queues of two make fi_writemsg say -FI_EAGAIN; the proxy posts later."""
    command = [sys.executable, LAUNCH, "-n", "8", "--ranks-per-node", "4", CHAPTER, "-p", "shm",
               *SMALL, "--check", "random,overflow", "--iters", "3"]
    done = Budget(LIMIT).run(command, cwd=ROOT, env=local_env({
        "FI_SHM_TX_SIZE": "2", "FI_SHM_RX_SIZE": "2", "FI_SHM_DISABLE_CMA": "1"}))
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(check_lines(done.stdout)) == 4
    eagain = re.search(r"proxy of rank 0: (\d+) WRITEs, -FI_EAGAIN (\d+) times", done.stdout)
    assert eagain and int(eagain[1]) > 0 and int(eagain[2]) > 0, done.stdout


@pytest.mark.parametrize("spoil", ["swap rows", "drop a scale", "count", "combine"])
def test_the_check_sees_a_wrong_result(one_rank, monkeypatch, spoil):
    """The check is not a formality: one wrong byte, count or sum and it says so."""
    moe, a2a = one_rank
    if spoil == "combine":
        real = a2a.combine_recv
        monkeypatch.setattr(a2a, "combine_recv", lambda w: real(w) * 1.01)
    else:
        real = a2a.dispatch_recv

        def spoiled():
            tokens, scales, counts = real()
            if spoil == "swap rows":
                tokens[[0, -1]] = tokens[[-1, 0]]
            elif spoil == "drop a scale":
                scales[0, 0] = 0
            else:
                counts = counts.copy()
                counts[0] += 1
            return tokens, scales, counts
        monkeypatch.setattr(a2a, "dispatch_recv", spoiled)
    ok, seen = harness.check_case(a2a, "random", seed=3)
    assert not ok
    if spoil == "combine":
        assert seen["error"] > seen["tolerance"]
    else:
        assert not seen["counts" if spoil == "count" else "rows"]


# --- on GPUs (skipped here): the same, with --device cuda -------------------------------

@needs_gpu
@pytest.mark.parametrize("ranks,per_node", [(2, 2), (2, 1), (4, 2), (8, 4)],
                         ids=["2-one-node", "2-two-nodes", "4-two-nodes", "8-two-nodes"])
def test_gpu_every_case_matches_the_reference(ranks, per_node):
    """--device cuda: GPU memory and cupy, the host still driving (chapter 17 hands it to
    the GPU)."""
    command = [sys.executable, LAUNCH, "-n", str(ranks), "--ranks-per-node", str(per_node),
               "--gpus", gpus(), CHAPTER, "-p", "shm", "--device", "cuda", *SMALL,
               "--iters", "0"]
    done = Budget(LIMIT).run(command, env=local_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = check_lines(done.stdout)
    assert set(lines) == {(d, c) for d in ("fp8", "bf16") for c in ref.CASES}
    assert all(ok == of == ranks for _, ok, of in lines.values())


@pytest.mark.parametrize("args,pattern", [
    (["-n", "3", "--ranks-per-node", "2", CHAPTER], "--ranks-per-node (2) must divide"),
    (["-n", "2", "nosuch.py"], "no program 'nosuch.py'"),
    (["-n", "2", "--gpus", "0,x", CHAPTER], "--gpus takes numbers like 0,1"),
])
def test_launcher_bad_input_is_one_line(args, pattern):
    done = Budget(LIMIT).run([sys.executable, LAUNCH, *args], env=local_env(), cwd=ROOT)
    assert_one_line_error(done, pattern)


@pytest.mark.long
def test_a_rank_that_never_comes_is_reported():
    """torchrun-style: rank 0 of 2 alone; it serves the rendezvous, waits, says why it stops."""
    start = time.monotonic()
    done = Budget(LIMIT).run([sys.executable, CHAPTER, "--iters", "0", "--check", "none",
                              "--timeout", "2"], cwd=ROOT, env=local_env({
                              "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                              "MASTER_PORT": str(free_port() - 1)}))
    assert time.monotonic() - start < 15
    assert_one_line_error(done, "only 1 of 2 ranks joined the rendezvous within 2 s")


@pytest.mark.long
def test_torchrun_style_rank_0_killed_stops_the_other():
    """Without our launcher rank 0 serves the rendezvous: when it dies, the others learn it.
    (One node: a killed rank's libfabric shm files would stay, with no launcher to remove
    them.)"""
    port = free_port() - 1
    procs = [subprocess.Popen(
        [sys.executable, CHAPTER, *SMALL, "--check", "none", "--iters", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=local_env({"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})) for r in range(2)]
    try:
        budget = Budget(LIMIT)
        while "benchmark" not in procs[0].stdout.readline():
            assert budget.left() > 0
        procs[0].kill()
        killed = time.monotonic()
        _, err = procs[1].communicate(timeout=30)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert elapsed < 15 and procs[1].returncode == 1
    assert err.strip() == ("16_moe.py: error: the rendezvous closed (its host, rank 0 or the "
                           "launcher, is gone)")


@pytest.mark.long
@pytest.mark.parametrize("per_node", [2, 1], ids=["one-node", "two-nodes"])
def test_a_hung_rank_is_named_and_the_job_ends(per_node):
    """A rank that stops answering (SIGSTOP) is not gone: the others time out naming it,
    then the launcher ends it."""
    proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "2", "--ranks-per-node",
                             str(per_node), "--grace", "1", CHAPTER, "-p", "shm", *SMALL,
                             "--check", "none", "--iters", "1000000", "--timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=local_env(), cwd=ROOT)
    try:
        pids = re.search(r"pids ([\d ]+)$", proc.stderr.readline())
        while "benchmark" not in proc.stdout.readline():
            pass
        stopped = time.monotonic()
        subprocess.run(["kill", "-STOP", pids[1].split()[1]], check=True)
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - stopped
    finally:
        proc.kill()
    assert proc.returncode == 1 and elapsed < 20, (elapsed, err)
    # in a stamp wait it names the rank; in a rendezvous barrier, the rendezvous does.
    # Its proxy may be in a provider call the frozen peer holds up (1.x's shm spins there):
    # then the same line says so and the rank ends without closing (common/bounds.join)
    assert re.search(r"^\[0\] 16_moe.py: error: (no \w[\w ]* from rank 1 within 2 s|stopping: "
                     r"rank 1 gave no sign of life for 2 s \(frozen, or its host is gone\))"
                     r"(; then the proxy: proxy did not stop within \d+ s \(stuck in a provider "
                     r"call\): exiting without closing)?$", err, re.MULTILINE), err
    assert re.search(r"^launch: rank (0 exited with code 1|1 was killed|1 gave no sign of "
                     r"life)", err, re.MULTILINE), err


@pytest.mark.long
def test_a_rank_frozen_at_its_start_is_named_and_the_job_ends():
    """A rank stopped (SIGSTOP) while it still imports never joins: the launcher sees its
    process stopped, and the others stop within --timeout + 5 s, naming it, not when the
    first barrier gives up on it (--timeout + 5 s after their own join)."""
    budget = Budget(LIMIT)  # on a busy machine a rank takes longer to hear and to stop
    timeout, grace = (math.ceil(budget.grant(s)) for s in (3, 1))
    proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "4", "--grace", str(grace),
                             CHAPTER, "-p", "shm", *SMALL, "--check", "none", "--iters", "10",
                             "--timeout", str(timeout)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=local_env(), cwd=ROOT)
    try:
        pids = [int(p) for p in re.search(r"pids ([\d ]+)$", proc.stderr.readline())[1].split()]
        os.kill(pids[2], signal.SIGSTOP)  # before any rank could import numpy
        frozen = time.monotonic()
        _, err = budget.communicate(proc)
        elapsed = time.monotonic() - frozen
    finally:
        kill_job(proc, pids)
    silent = f"rank 2 gave no sign of life for {timeout} s (frozen, or its host is gone)"
    assert proc.returncode == 1 and "Traceback" not in err, err
    for rank in (0, 1, 3):
        assert f"[{rank}] 16_moe.py: error: stopping: {silent}\n" in err, err
    assert f"launch: {silent}; all 4 ranks stopped" in err, err
    assert elapsed < budget.grant(timeout + 5 + grace + launch.KILL_WAIT), elapsed

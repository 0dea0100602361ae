"""Chapter 19: the routing table covers every inference byte exactly once for uneven
shardings, shards quantised with their neighbours' edge maxima equal the whole tensor's
quantisation, the check counts a flipped byte; runs of trainers and inference ranks on shm
and tcp exact after two updates and the naive way; a rank gone mid-update, or frozen
between two; bad input; nothing of the MoE chapters loaded."""
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from common import shm_files
from common.launch import KILL_WAIT
from common.gpu import rounding
from common.weights import BLOCK
from common.weights.check import Check
from common.weights.model import MODELS, inference_tensors, lay_out, parameters, values, \
    views
from common.weights.ops import HostOps, e4m3
from common.chapter_pair import ROOT, chapter_module, local_env
from tests.support.budget import Budget
from tests.support.gpu import needs_gpu
from tests.support.processes import kill_job

pytest.importorskip("common.transfer")  # skipped only if the engine's worker is not built
CHAPTER = ROOT / "chapters" / "19_weight_update.py"
LAUNCH = str(ROOT / "scripts" / "launch.py")
LIMIT = 240  # seconds for a whole job on 2 busy cores
TINY = dict(MODELS["tiny"])


@pytest.fixture(scope="module")
def ch19():
    return chapter_module(19)


def plan_of(ch19, trainers, inference, model=TINY, inference_model=None):
    params = parameters(model)
    layouts = [lay_out(inference_tensors(inference_model or model, inference, r))
               for r in range(inference)]
    return ch19.Plan(params, trainers, layouts, 1 << 20)


@pytest.mark.parametrize("trainers,inference", [(3, 2), (1, 2), (7, 1), (2, 2), (5, 1)])
def test_the_plan_writes_every_inference_byte_exactly_once(ch19, trainers, inference):
    plan = plan_of(ch19, trainers, inference)
    for r, tensors in enumerate(plan.layouts):
        covered = np.zeros(tensors[-1].end, np.int64)
        for t in range(trainers):
            for jobs in plan.jobs[t].values():
                for job in (j for j in jobs if j.r == r):
                    for w in job.writes:
                        covered[w.dst:w.dst + w.length] += 1
        wanted = np.zeros_like(covered)
        for tensor in tensors:
            wanted[tensor.offset:tensor.offset + tensor.bytes] = 1
            if tensor.fp8:
                wanted[tensor.scales:tensor.scales + (tensor.rows // BLOCK)
                       * (tensor.cols // BLOCK) * 4] = 1
        assert np.array_equal(covered, wanted), f"rank {r}: {np.flatnonzero(covered != wanted)[:5]}"
        assert sum(plan.counts(r).values()) == sum(
            len(j.writes) for t in range(trainers) for jobs in plan.jobs[t].values()
            for j in jobs if j.r == r)
    for t in range(trainers):  # each shared block on both sides, in the same order
        for u, blocks in plan.edges(t).items():
            assert [(p.index, b) for p, b in blocks] == \
                [(p.index, b) for p, b in plan.edges(u)[t]]
    if trainers in (3, 5, 7):  # 256 rows in shards of 86, 52, 37: blocks straddle them
        assert any(plan.edges(t) for t in range(trainers))


def test_fused_and_sharded_tensors_take_the_right_rows(ch19):
    tensors = {t.name: t for t in lay_out(inference_tensors(TINY, 2, 1))}
    qkv = tensors["model.layers.0.self_attn.qkv_proj.weight"]
    assert [(p.source.split(".")[-2], p.row0, p.row1, p.at_row) for p in qkv.pieces] == \
        [("q_proj", 256, 512, 0), ("k_proj", 128, 256, 256), ("v_proj", 128, 256, 384)]
    o = tensors["model.layers.0.self_attn.o_proj.weight"]
    assert (o.rows, o.cols, o.pieces[0].col0, o.pieces[0].col1) == (256, 256, 256, 512)
    experts = sorted(n.split(".")[5] for n in tensors if "gate_up_proj" in n and ".0." in n)
    assert experts == ["2", "3"]  # expert-parallel: rank 1 of 2 holds experts 2 and 3
    embed = tensors["model.embed_tokens.weight"].pieces[0]
    assert (embed.row0, embed.row1) == (256, 512)


def test_shards_quantised_with_shared_edge_maxima_equal_the_whole_tensor():
    rng = np.random.default_rng(3)
    whole = rounding.to_bf16(rng.standard_normal((384, 256)).astype(np.float32)
                        * np.float32(2.0) ** rng.integers(-8, 8, (384, 1)))
    whole[128:256, 128:] = 0  # a block of zeros: scale 1
    codes, scales = rounding.quantize_fp8(rounding.from_bf16(whole), BLOCK)
    cuts = [0, 100, 110, 300, 384]  # block 0 split in two, block 0 and 2 in three shards...
    parts = []
    for lo, hi in zip(cuts, cuts[1:]):
        blocks = (hi - 1) // BLOCK - lo // BLOCK + 1
        amax = np.zeros(blocks * 2, np.float32)
        HostOps.amax(whole[lo:hi], lo, amax)
        parts.append((lo, hi, amax.reshape(blocks, 2)))
    full = np.zeros((3, 2), np.float32)  # what the edge exchange gives every shard
    for lo, hi, amax in parts:
        first = lo // BLOCK
        full[first:first + len(amax)] = np.maximum(full[first:first + len(amax)], amax)
    for lo, hi, amax in parts:
        first = lo // BLOCK
        mine = rounding.fp8_scales(full[first:first + len(amax)]).ravel()
        for c0 in (0, 128):  # the whole width, and a column shard (o_proj's)
            out = np.zeros((hi - lo) * 128, np.uint8)
            HostOps.codes(whole[lo:hi], lo, mine, 2, c0, 128, out)
            assert np.array_equal(out.reshape(hi - lo, 128), codes[lo:hi, c0:c0 + 128])
    assert np.array_equal(rounding.fp8_scales(full), scales)


def test_the_kernels_rounding_in_numpy_matches_the_reference():
    table = rounding.E4M3
    middles = (table[1:] + table[:-1]) / 2
    x = np.concatenate([table, middles, np.nextafter(middles, 0), np.nextafter(middles, 1e9),
                        [0.0, 1e-9, 447.9, 448.0, 460.0, 1e6]]).astype(np.float32)
    x = np.concatenate([x, -x])
    assert np.array_equal(e4m3(x), rounding.to_e4m3(x))


def test_the_weight_update_needs_nothing_of_the_moe_chapters():
    """Chapter 19 and common/weights take fp8, bf16 and the layout of a region from
    common/gpu/, not from the MoE chapters' scaffolding: nothing of common.moe is loaded."""
    code = ("import sys; from common.chapter_pair import chapter_module; chapter_module(19); "
            "print(sorted(m for m in sys.modules if m.startswith('common.moe')))")
    done = Budget(60).run([sys.executable, "-c", code], env=local_env(), cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_check_counts_a_flipped_byte(ch19):
    plan = plan_of(ch19, 2, 1)
    tensors = plan.layouts[0]
    weights = np.zeros(tensors[-1].end, np.uint8)
    check = Check(plan.params, tensors, weights, np, 5)
    versions = {p.index: 1 for p in plan.params}
    names = {p.name: p for p in plan.params}
    for tensor in tensors:  # what the updates should leave, from the reference
        data, scales = views(np, weights, tensor)
        for piece in tensor.pieces:
            x = values(np, 5, names[piece.source], 1, piece.row0, piece.row1)
            at, height = piece.at_row, piece.row1 - piece.row0
            if scales is None:
                data[at:at + height] = x
                continue
            codes, s = rounding.quantize_fp8(rounding.from_bf16(x), BLOCK)
            data[at:at + height] = codes[:, piece.col0:piece.col1]
            scales[at // BLOCK:(at + height) // BLOCK] = \
                s[:, piece.col0 // BLOCK:piece.col1 // BLOCK]
    assert check(versions, {})["wrong"] == 0
    qkv = next(t for t in tensors if t.name.endswith("qkv_proj.weight"))
    weights[qkv.offset + 777] ^= 1
    weights[qkv.scales + 5] ^= 0x40
    found = check(versions, versions)
    assert found["wrong"] == 1 + 4 and found["changed"] == 1 and found["expected_changed"] == 0


def launched(ranks, *args, gpus=None):
    return Budget(LIMIT).run([sys.executable, LAUNCH, "-n", str(ranks),
                           *(["--gpus", gpus] if gpus else []), str(CHAPTER), "--model", "tiny",
                           *args], env=local_env(), cwd=ROOT)


def exact(done, inference):
    out = done.stdout
    assert done.returncode == 0 and "[0] all checks passed" in out, out + done.stderr
    lines = re.findall(r"^\[0\] (update \d|naive).*checked on (\d) inference ranks?: 0 wrong "
                       r"bytes; (\d+) tensors changed \((\d+) expected\)$", out, re.M)
    assert [line[0] for line in lines] == ["update 1", "update 2", "naive"], out
    assert all(int(line[1]) == inference and line[2] == line[3] for line in lines), lines
    assert int(lines[1][2]) > 0 and int(lines[2][2]) == 0, lines  # the 2nd changes a third


@pytest.mark.parametrize("provider,ranks,trainers", [
    ("shm", 5, 3), pytest.param("tcp", 3, 1, marks=pytest.mark.long),
    pytest.param("tcp", 4, 3, marks=pytest.mark.long)])
def test_two_updates_and_the_naive_way_leave_every_weight_exact(provider, ranks, trainers):
    done = launched(ranks, "-p", provider, "--trainers", str(trainers))
    exact(done, ranks - trainers)
    table = re.findall(r"^\[0\]   (edge maxima \(full_tensor\(\)\)|waiting for other ranks|"
                       r"quantise|RDMA submit|transfer not hidden) +[\d.]+ +[\d.]+ +\d+", 
                       done.stdout, re.M)
    assert len(table) == 2 * 5, done.stdout


@pytest.mark.long
@pytest.mark.parametrize("side,says", [
    ("trainer", r"inference rank \d: update 2 incomplete, .* stale \(not all their WRITEs came\)"),
    # the rendezvous says it when rank 3's connection closes or when the launcher reaps it
    ("inference", r"trainer \d: update 2 stopped \(stopping: rank 3 (is gone|was killed)")])
def test_a_rank_gone_mid_update_is_said_by_the_others(side, says):
    done = launched(4, "-p", "shm", "--trainers", "2", "--fail", side, "--timeout", "5")
    assert done.returncode != 0
    assert re.search(rf"killing myself mid-update 2 \(--fail {side}\)", done.stdout), done.stdout
    assert re.search(says, done.stderr), done.stderr
    assert "Traceback" not in done.stderr and "was killed by SIGKILL" in done.stderr


@pytest.mark.long
def test_a_rank_frozen_between_updates_stops_the_job_within_the_bound():
    """Between two updates the ranks meet at the rendezvous, which may wait long for a rank
    busy with gigabytes (30 x --timeout); a frozen trainer (SIGSTOP) is silent, and its
    silence for --timeout is what stops the others, not that wait."""
    budget = Budget(LIMIT)  # a rank that this busy machine starves must not look frozen
    timeout, grace = (math.ceil(budget.grant(s)) for s in (5, 2))
    proc = subprocess.Popen([sys.executable, LAUNCH, "-n", "3", "--grace", str(grace),
                             str(CHAPTER), "-p", "shm", "--timeout", str(timeout), "--updates",
                             "3", "--naive", "no"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=local_env(), cwd=ROOT)
    try:
        pids = [int(p) for p in re.search(r"pids ([\d ]+)$", proc.stderr.readline())[1].split()]
        while not proc.stdout.readline().startswith("[0] update 1 "):
            assert budget.left() > 0 and proc.poll() is None
        os.kill(pids[1], signal.SIGSTOP)  # trainer 1, filling its shards for update 2
        frozen = time.monotonic()
        _, err = budget.communicate(proc)
        elapsed = time.monotonic() - frozen
    finally:
        kill_job(proc, pids)
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert f"launch: rank 1 gave no sign of life for {timeout} s (frozen, or its host is gone); " \
           "all 3 ranks stopped" in err, err
    assert elapsed < budget.grant(timeout + 5 + grace + KILL_WAIT), elapsed
    left = shm_files.remove_left_by(pids)
    assert not left, f"left in /dev/shm: {sorted(left)}"


@pytest.mark.long
@pytest.mark.parametrize("args,pattern", [
    (["--inference-config", "layers=3"], "asks for model.layers.2.input_layernorm.weight"),
    (["--inference-config", "hidden=512"],
     "model.embed_tokens.weight: the trainers hold 512 x 256, inference rank 0 expects 512 x 512"),
    (["--inference-config", "nope=1"], "'nope=1' is not KEY=NUMBER"),
    (["--staging", "1K"], "--staging 1024: trainer"),
    (["--trainers", "3"], "--trainers 3 leaves no inference rank of 3"),
    (["--fail", "trainer", "--updates", "1"], "--fail acts in update 2"),
])
def test_bad_input_is_one_line_on_every_rank(args, pattern):
    done = launched(3, "-p", "shm", *args)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert errors and all(pattern in line or "is gone" in line for line in errors), errors
    assert any(pattern in line for line in errors), errors


@pytest.mark.long
def test_alone_it_says_how_to_start_the_job():
    done = Budget(LIMIT).run([sys.executable, str(CHAPTER)], env=local_env(), cwd=ROOT)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "it takes trainers and inference ranks: " in lines[0], lines
    assert "scripts/launch.py -n 3 chapters/19_weight_update.py" in lines[0]


@needs_gpu
def test_on_the_gpu_the_kernels_leave_every_weight_exact():
    exact(launched(5, "-p", "shm", "--trainers", "3", "--device", "cuda", gpus="0"), 2)

"""Chapter 17: the GPU-driven all-to-all against the reference on one and two emulated
nodes, with counts on the device, in CUDA graphs, with torch tensors; bad input. The GPU
tests are skipped where there is no GPU; the flags are checked anywhere."""
import importlib.util
import json
import re
import sys

import pytest

import common.fabric as fi
from common import launch
from common.moe import harness
from common.moe import reference as ref
from common.chapter_pair import ROOT, chapter_module, chapter_path, local_env
from tests.support.budget import Budget
from tests.support.gpu import needs_gpu
from tests.support.moe_runs import BAD_BATCHES, LAUNCH, LIMIT, SMALL, check_lines, gpu_count, gpus
from tests.support.one_line_errors import assert_one_line_error, run

CHAPTER = str(chapter_path(17))
GRAPH_LINE = re.compile(r"^\[0\] check graph fp8: one layer captured, replayed 100 times with "
                        r"new inputs, each replay exact on (\d+) of (\d+) ranks$", re.MULTILINE)


@pytest.mark.long
@pytest.mark.parametrize("args,pattern", [
    (["--graph"], "--graph needs --counts device"),
    (["--counts", "gpu"], "argument --counts: invalid choice"),
    (["--tokens", "1,x"], "--tokens takes numbers like 1,8,128"),
    (["--topk", "17"], "top-k (17) must be 1..16"),
])
def test_bad_input_is_one_line(args, pattern):
    assert_one_line_error(run(17, *SMALL, *args)[0], pattern)


def test_what_reaches_other_nodes_is_named_in_the_kernels_order():
    """The chapter's FAR names the numbers of `far` in the order the kernels index them
    (enum M17_FAR in the .cu): a name out of place would hand a kernel the wrong address."""
    enum = re.search(r"enum M17_FAR \{([^}]*)\}", (ROOT / "chapters" / "17_gpu_driven.cu")
                     .read_text())[1]
    kernels = [name.strip().removeprefix("M17_").lower() for name in enum.split(",")]
    assert list(chapter_module(17).FAR) == kernels


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is here")
def test_no_cupy_is_one_line():  # the fast tier's run of 17 where there is no GPU
    assert_one_line_error(run(17, *SMALL, "--iters", "0")[0], "cupy")


def test_sizes_the_kernels_cannot_take_are_refused_up_front():
    moe = chapter_module(17)
    with pytest.raises(ValueError, match=r"^8192 experts: the plan kernel keeps 3 ints per "
                       r"expert in one block's shared memory, 4096 experts at most$"):
        moe.check_sizes(moe.NodeLayout(1, 8192, 4, 2, 128, "fp8", 8), 2**40)
    L = moe.NodeLayout(8, 256, 4096, 8, 7168, "fp8", 8)
    with pytest.raises(ValueError, match=r"^the region needs 5\.31 GiB of GPU memory .*, "
                       r"1.00 GiB are free: fewer --max-tokens"):
        moe.check_sizes(L, 2**30)
    moe.check_sizes(L, 2**40)  # room: nothing said


# --- on GPUs (skipped here) ------------------------------------------------------------

def launched(ranks, per_node, *args):
    command = [sys.executable, LAUNCH, "-n", str(ranks), "--ranks-per-node", str(per_node),
               "--gpus", gpus(), CHAPTER, "-p", "shm", *SMALL, *args]
    return Budget(LIMIT).run(command, env=local_env(), cwd=ROOT)


@needs_gpu
@pytest.mark.parametrize("ranks,per_node,counts", [
    (1, 1, "host"), (2, 2, "host"), (4, 4, "host"), (8, 8, "host"), (2, 1, "host"),
    (4, 2, "host"), (8, 4, "host"), (4, 4, "device"), (4, 2, "device")],
    ids=["1-rank", "2-one-node", "4-one-node", "8-one-node", "2-two-nodes", "4-two-nodes",
         "8-two-nodes", "4-one-node-counts-on-gpu", "4-two-nodes-counts-on-gpu"])
def test_gpu_every_case_matches_the_reference(ranks, per_node, counts):
    # the baseline wants a GPU per rank
    baseline = ["--baseline", "nccl"] if 1 < ranks <= gpu_count() else []
    done = launched(ranks, per_node, "--counts", counts, *baseline, "--iters", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    ours = {k: v for k, v in check_lines(done.stdout).items() if k[0] != "nccl"}
    assert set(ours) == {(d, c) for d in ("fp8", "bf16") for c in ref.CASES}
    assert all(ok == of == ranks for _, ok, of in ours.values())
    assert done.stdout.count("all checks passed") == 1 + bool(baseline)  # ours, NCCL's


@needs_gpu
@pytest.mark.parametrize("ranks,per_node", [(1, 1), (2, 2), (2, 1)],
                         ids=["1-rank", "2-one-node", "2-two-nodes"])
def test_gpu_one_layer_in_a_cuda_graph_replayed_100_times(ranks, per_node):
    """Captured once; every replay gets new inputs in the same buffers, advances the round
    on the GPU (the peers' flags would not match otherwise) and is checked."""
    done = launched(ranks, per_node, "--counts", "device", "--graph", "--check", "random",
                    "--iters", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert GRAPH_LINE.search(done.stdout).groups() == (str(ranks), str(ranks)), done.stdout


@needs_gpu
@pytest.mark.parametrize("tokens,indices,pattern", BAD_BATCHES)
def test_gpu_bad_batches_are_refused_and_nothing_moves(tokens, indices, pattern):
    """The route kernel checks index values: dispatch_recv says so, nothing was pushed,
    and a good batch goes on."""
    moe = chapter_module(17)
    group = launch.Group(launch.Place(0, 1, 1, 0, None, False, "test"))
    with fi.Closer() as own:
        a2a = moe.AllToAll(own, group, max_tokens=4, experts=8, topk=2, hidden=128,
                           timeout=5.0)
        cp = a2a.xp
        with pytest.raises(ValueError, match=re.escape(pattern)):
            a2a.dispatch_send(cp.ones((tokens, 128), cp.float32), cp.asarray(indices))
            a2a.dispatch_recv()
        assert a2a.stage == "idle"
        assert not bool(a2a.mem.data[:a2a.L.overflow].any())  # no flag raised, no count sent
        a2a.dispatch_send(cp.ones((1, 128), cp.float32), cp.asarray([[0, 5]]))
        tokens_out, scales, counts = a2a.dispatch_recv()
        assert counts.tolist() == [1, 0, 0, 0, 0, 1, 0, 0] and tokens_out.shape == (2, 128)


@needs_gpu
def test_gpu_counts_on_the_device():
    """counts="device": dispatch_recv hands out the whole buffers and the counts in GPU
    memory without waiting; combine takes an output for every row of them; a refused
    batch is said by combine_recv, and the next goes on."""
    moe = chapter_module(17)
    group = launch.Group(launch.Place(0, 1, 1, 0, None, False, "test"))
    with fi.Closer() as own:
        a2a = moe.AllToAll(own, group, max_tokens=4, experts=8, topk=2, hidden=128,
                           timeout=5.0, counts="device")
        cp = a2a.xp
        rows = a2a.L.world * a2a.L.per_peer  # 8: what one sender may send us
        for indices, received in (([[0, 5], [1, 5]], [1, 1, 0, 0, 0, 2, 0, 0]),
                                  ([[7, 2], [2, 3]], [0, 0, 2, 1, 0, 0, 0, 1])):
            a2a.dispatch_send(cp.ones((2, 128), cp.float32), cp.asarray(indices))
            tokens, scales, counts = a2a.dispatch_recv()
            assert isinstance(counts, cp.ndarray) and counts.tolist() == received
            assert tokens.shape == (rows, 128) and scales.shape == (rows, 1)
            with pytest.raises(ValueError, match=r"expert outputs must be \(8, 128\)"):
                a2a.combine_send(cp.ones((4, 128), cp.float32))
            a2a.combine_send(cp.ones((rows, 128), cp.float32))
            out = a2a.combine_recv(cp.full((2, 2), 0.5, cp.float32))
            assert bool((out == 1).all())  # 0.5 * 1 + 0.5 * 1
            a2a.dispatch_send(cp.ones((2, 128), cp.float32), cp.asarray([[0, 8], [1, 2]]))
            assert a2a.dispatch_recv()[2].tolist() == [0] * 8
            a2a.combine_send(cp.ones((rows, 128), cp.float32))
            with pytest.raises(ValueError, match=re.escape("expert index out of range 0..7")):
                a2a.combine_recv(cp.full((2, 2), 0.5, cp.float32))
            assert a2a.stage == "idle"


@needs_gpu
def test_gpu_a_graph_needs_counts_on_the_device():
    moe = chapter_module(17)
    group = launch.Group(launch.Place(0, 1, 1, 0, None, False, "test"))
    with fi.Closer() as own:
        a2a = moe.AllToAll(own, group, max_tokens=4, experts=8, topk=2, hidden=128,
                           timeout=5.0)
        cp, stream = a2a.xp, a2a.mem.stream
        x, indices = cp.ones((1, 128), cp.float32), cp.asarray([[0, 5]])
        with stream:
            stream.begin_capture()
            with pytest.raises(ValueError, match="a CUDA graph cannot wait on the host"):
                a2a.dispatch_send(x, indices)
            stream.end_capture()
        assert a2a.stage == "idle"


def torch_or_skip():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@needs_gpu
def test_gpu_torch_tensors_in_and_out_on_the_callers_stream_and_in_a_torch_graph():
    """A serving engine's view: torch tensors in, torch tensors out (the same memory, no
    copy), the work ordered on the caller's stream (a side stream here), and the layer
    captured by torch.cuda.graph, replayed with new inputs, each replay checked."""
    torch = torch_or_skip()
    moe = chapter_module(17)
    group = launch.Group(launch.Place(0, 1, 1, 0, None, False, "test"))
    with fi.Closer() as own:
        a2a = moe.AllToAll(own, group, max_tokens=8, experts=16, topk=4, hidden=256,
                           timeout=10.0, counts="device")
        cases = [harness.case_inputs(a2a.L, 0, "fp8", "random", seed) for seed in range(6)]

        def on_gpu(case):
            return [torch.as_tensor(a).cuda() for a in case[:4]]

        def checked(case, tokens, scales, counts, out):
            return harness.verdict(case, counts.cpu().numpy(), tokens.cpu().numpy(),
                                   scales.cpu().numpy(), out.cpu().numpy())

        side = torch.cuda.Stream()
        for case in cases[:3]:
            x, indices, weights, answers = on_gpu(case)
            side.wait_stream(torch.cuda.current_stream())  # the inputs' copies
            with torch.cuda.stream(side):
                a2a.dispatch_send(x, indices)
                tokens, scales, counts = a2a.dispatch_recv()
                a2a.combine_send(answers)
                out = a2a.combine_recv(weights)
                assert all(isinstance(t, torch.Tensor) for t in (tokens, scales, counts, out))
                ok, seen = checked(case, tokens, scales, counts, out)  # on the side stream
            assert ok, seen
        assert tokens.data_ptr() == a2a.tokens.data.ptr  # the chapter's buffer, not a copy

        static = on_gpu(cases[0])
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a2a.dispatch_send(static[0], static[1])
            tokens, scales, counts = a2a.dispatch_recv()
            a2a.combine_send(static[3])
            out = a2a.combine_recv(static[2])
        for case in cases:
            for buffer, values in zip(static, case[:4]):
                buffer.copy_(torch.as_tensor(values))
            graph.replay()
            torch.cuda.synchronize()
            a2a.check()
            ok, seen = checked(case, tokens, scales, counts, out)
            assert ok, seen


@needs_gpu
def test_gpu_decode_benchmark_against_nccl_and_in_graphs(tmp_path):
    path = tmp_path / "moe.json"
    two = gpu_count() >= 2
    command = [sys.executable, LAUNCH, "-n", "2" if two else "1", "--gpus", gpus(), CHAPTER,
               *(["--baseline", "nccl"] if two else []), "--counts", "device", "--graph",
               "--check", "none", "--tokens", "1,8", "--iters", "20", "--json", str(path)]
    done = Budget(LIMIT).run(command, env=local_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(path.read_text())
    assert (data["chapter"], data["counts"], data["graph"]) == ("17_gpu_driven", "device", True)
    names = [(r["implementation"], r["tokens"]) for r in data["runs"]]
    assert names == [("ours", 1), ("ours", 8), *([("nccl", 1), ("nccl", 8)] if two else []),
                     ("ours, CUDA graphs", 1), ("ours, CUDA graphs", 8)]
    assert all(r["dispatch_p50_us"] > 0 for r in data["runs"])

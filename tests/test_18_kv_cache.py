"""Chapter 18 as a pair on this host: the KV cache arrives whole and verified on shm and tcp,
a cancel is confirmed, a peer gone is said in one line, bad input refused. On a GPU
(`-k gpu`): the bf16 product against float64, and the pair in bf16 and in fp32."""
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from common import shm_files
from common.chapter_pair import ADDRESS, chapter_module, chapter_path, local_env, run_pair
from common.gpu import rounding
from common.gpu.bf16 import gemm_bf16, to_bf16
from tests.support.budget import Budget
from tests.support.gpu import needs_gpu
from tests.support.one_line_errors import assert_one_line_error, run

SMALL = ["--tokens", "300", "--layers", "4", "--page-tokens", "64"]
FROZEN = Path(__file__).parent / "programs" / "frozen_decoder.py"


@pytest.mark.parametrize("provider", ["shm", pytest.param("tcp", marks=pytest.mark.long)])
def test_the_kv_cache_arrives_whole_and_verified(provider):
    pair = run_pair(18, provider, SMALL, [SMALL])
    assert pair.ok, pair
    out = pair.server.out
    assert "checked 40 pages and the context: 0 wrong bytes" in out, out  # 4 x 2 x 5 pages
    assert re.search(r"^per layer \(median of 4\): compute [\d.]+ ms, transfer [\d.]+ ms",
                     out, re.MULTILINE), out
    assert re.search(r"^time to first token: [\d.]+ ms prefill alone, [\d.]+ ms with the "
                     r"transfer \(300 tokens, 4 layers\)$", out, re.MULTILINE), out
    assert "prefiller: 4 layers sent, 40 pages" in pair.clients[0].out


@pytest.mark.long
def test_a_cancelled_request_is_confirmed_before_its_pages_are_free():
    pair = run_pair(18, "shm", [*SMALL, "--cancel-after", "1"], [SMALL])
    assert pair.ok, pair
    assert "request 1 cancelled after layer 1: the prefiller confirmed" in pair.server.out
    assert "cancelled by the decoder" in pair.clients[0].out


def start_decoder(*args, program=chapter_path(18)):
    server = subprocess.Popen([sys.executable, str(program), "-p", "shm", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=local_env())
    lines = []
    for line in server.stdout:
        lines.append(line)
        found = ADDRESS.search(line)
        if found:
            return server, found[1]
    raise AssertionError("".join(lines) + server.stderr.read())


def start_prefiller(address, *args):
    return subprocess.Popen([sys.executable, str(chapter_path(18)), "-p", "shm", *args, address],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=local_env())


def end_both(client, server, killed):
    """Kill what still runs, and remove what the process killed by the test left."""
    for proc in (client, server):
        proc.kill()
        proc.wait()
    shm_files.remove_left_by([killed.pid])  # a process killed with -9 removes nothing


@pytest.mark.long
@pytest.mark.parametrize("victim,survivor_says", [
    ("prefiller", "is the prefiller still there?"),
    ("decoder", "is the decoder still there?")])
def test_a_side_killed_mid_transfer_is_said_by_the_other_in_one_line(victim, survivor_says):
    long = ["--tokens", "1024", "--layers", "60", "--timeout", "5"]
    server, address = start_decoder(*long)
    client = start_prefiller(address, *long)
    killed, survivor = (client, server) if victim == "prefiller" else (server, client)
    try:
        for line in server.stdout:  # killed once the request went out
            if line.startswith("decoder: request 1"):
                break
        time.sleep(0.3)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        _, err = Budget(60).communicate(survivor)
    finally:
        end_both(client, server, killed)
    assert survivor.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and survivor_says in lines[0], err


@pytest.mark.long
def test_a_decoder_frozen_while_it_checks_is_said_by_the_prefiller_within_its_timeout():
    """The decoder checks every byte (it computes the prompt again) while the prefiller waits
    for the verdict: that wait, too, ends --timeout after the decoder's last sign of life."""
    budget = Budget(60)
    timeout = budget.grant(5)
    args = [*SMALL, "--timeout", f"{timeout:g}"]
    server, address = start_decoder(*args, program=FROZEN)
    client = start_prefiller(address, *args)
    try:
        _, err = budget.communicate(client)
    finally:
        end_both(client, server, server)
    assert client.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and f"within {timeout:g} s" in lines[0] and \
        "is the decoder still there?" in lines[0], err


@pytest.mark.long
@pytest.mark.parametrize("args,pattern", [
    (["--cancel-after", "3", "--layers", "4"], "--cancel-after must be a layer 0..2"),
    (["--cache-pages", "2", "--tokens", "1024"], "a request of 1024 tokens needs 8"),
    (["--model", "huge"], "argument --model: invalid choice"),
    (["--tokens", "0"], "expected a number 1.."),
    (["-p", "shm", "abcd"], "error: not an engine's address (2 bytes): copy the whole address "
                            "that the decoder printed, and give both the same -p and --nics"),
    (["zz"], "address: not a hex digit at position 0"),
    (["--dtype", "bf16"], "--dtype bf16 needs --gpu: the host (numpy) computes in fp32"),
])
def test_bad_input_is_one_line(args, pattern):
    done, _ = run(18, *args)
    assert_one_line_error(done, pattern)


class SlowWatcher(threading.Thread):
    """A cancelled watcher whose last WRITEs complete one every 0.2 s for 2 s."""

    def __init__(self, timeout):
        super().__init__(daemon=True)
        self.timeout, self.progress, self.cancelled = timeout, time.perf_counter(), False

    def run(self):
        for _ in range(10):
            time.sleep(0.2)
            self.progress = time.perf_counter()


@pytest.mark.long
def test_a_cancel_waits_for_writes_that_still_complete(monkeypatch):
    """The prefiller's WRITEs in flight when a request is cancelled may take seconds: it
    waits for them as long as they complete, instead of taking a watcher still busy after
    a second for one stuck in the provider (which ends the process)."""
    ch = chapter_module(18)
    monkeypatch.setattr(ch.bounds, "end", lambda line, code: pytest.fail(line))
    watcher = SlowWatcher(timeout=1.0)
    watcher.start()
    ch.wind_down(watcher)
    assert watcher.cancelled and not watcher.is_alive()


def cupy_or_skip():
    """cupy on a GPU, else a skip: the bf16 product needs no libfabric (needs_gpu asks that
    of the pairs)."""
    cupy = pytest.importorskip("cupy", reason="needs a GPU and cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if not count:
        pytest.skip("needs a GPU")
    return cupy


def test_gpu_bf16_rounding_is_the_references():
    """common/gpu/bf16.py's one-pass kernel gives the bits of common/gpu/rounding.py's
    to_bf16: ties to even, overflow to infinity, NaN kept, signed zeros."""
    cupy = cupy_or_skip()
    special = [1.0, -2.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -7, 0.0, -0.0, np.inf,
               -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40, -1e-45]
    x = np.concatenate([np.array(special, np.float32),
                        np.random.default_rng(0).standard_normal(100_000).astype(np.float32)])
    got = cupy.asnumpy(to_bf16(cupy.asarray(x)))
    assert got.dtype == np.uint16 and np.array_equal(got, rounding.to_bf16(x))


@pytest.mark.parametrize("m,k,n", [(300, 512, 384), (1, 4096, 128), (4096, 128, 4096)])
def test_gpu_bf16_gemm_is_the_product_of_its_bf16_inputs(m, k, n):
    """gemm_bf16 (cuBLAS gemmEx, bf16 in, float32 accumulated) against float64 on the host
    of the same bf16 values: within bf16's own rounding step (2^-8) of the size of the
    terms; a wrong layout or transposition is off by the order of the terms themselves."""
    cupy = cupy_or_skip()
    rng = np.random.default_rng(m + k + n)
    a = rounding.to_bf16(rng.standard_normal((m, k)).astype(np.float32))
    b = rounding.to_bf16((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))
    got = cupy.asnumpy(gemm_bf16(cupy.asarray(a), cupy.asarray(b)))
    a64, b64 = rounding.from_bf16(a).astype(np.float64), rounding.from_bf16(b).astype(np.float64)
    want, scale = a64 @ b64, np.abs(a64) @ np.abs(b64)
    assert got.dtype == np.float32 and got.shape == (m, n)
    worst = float(np.max(np.abs(got - want) / scale))
    assert worst <= 2 ** -8, f"max |error| / (|a| @ |b|) = {worst:.2e}"


@needs_gpu
@pytest.mark.parametrize("flags,dtype", [([], "bf16"), (["--dtype", "fp32"], "fp32")],
                         ids=["bf16-default", "fp32"])
def test_gpu_the_kv_cache_arrives_whole_and_verified(flags, dtype):
    """GPU memory, cupy's products on GPU 0: the decoder recomputes the prompt in the same
    dtype and finds every byte of the pages and the context as the prefiller sent them."""
    args = [*SMALL, "--gpu", "0", *flags]
    pair = run_pair(18, "shm", args, [args])
    assert pair.ok, pair
    out = pair.server.out
    assert "checked 40 pages and the context: 0 wrong bytes" in out, out  # 4 x 2 x 5 pages
    assert f"300 tokens, 64 a page, {dtype} products" in out, out
    assert f"300 tokens, 64 a page, {dtype} products" in pair.clients[0].out, pair.clients[0].out


@needs_gpu
def test_gpu_a_prefiller_of_another_dtype_is_refused_in_one_line():
    args = [*SMALL, "--gpu", "0"]
    pair = run_pair(18, "shm", args, [[*args, "--dtype", "fp32"]])
    client = pair.clients[0]
    assert client.rc == 1, client
    lines = client.err.strip().splitlines()
    assert len(lines) == 1 and "the decoder computes in bf16, we in fp32: give both the " \
        "same --dtype" in lines[0], client.err

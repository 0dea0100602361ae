"""scripts/nixl_pages.py: NIXL (UCX backend) moves a few pages between two processes here
and the target finds every byte; without nixl the script says how to get it, in one line.

The repo's .venv has no nixl: these tests run the script with the interpreter that has it,
this one or NIXL_PYTHON (a venv of its own with `pip install nixl-cu13`, e.g.
NIXL_PYTHON=nixlenv/bin/python .venv/bin/pytest tests/test_script_nixl_pages.py), with this
repository on its PYTHONPATH as scripts/transfer_bench.py runs it."""
import json
import os
import subprocess
import sys

import pytest

from common.records import ROOT
from scripts.transfer_bench import nixl_env
from tests.support.nixl_python import HERE, NIXL_PYTHON, WHY

SCRIPT = ROOT / "scripts" / "nixl_pages.py"


def gpu_why(python):
    """None where `python` has GPU 0 as nixl_pages.py takes it (cupy, or torch with CUDA),
    else the script's one line saying why not."""
    probe = ("import sys; from scripts import nixl_pages\n"
             "try: nixl_pages.gpu_allocator(0)\nexcept ValueError as e: sys.exit(str(e))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=nixl_env())
    return None if done.returncode == 0 else done.stderr.strip().splitlines()[-1]


GPU_WHY = WHY or gpu_why(NIXL_PYTHON)


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
@pytest.mark.parametrize("gpu", [None, pytest.param(
    0, marks=pytest.mark.skipif(GPU_WHY is not None, reason=GPU_WHY or ""))])
def test_a_tiny_transfer_arrives_whole(tmp_path, gpu):
    record = tmp_path / "nixl.json"
    done = subprocess.run([NIXL_PYTHON, str(SCRIPT), "--page-size", "1K,4K", "--pages", "16",
                           "--repeats", "2", "--warmup", "1", "--json", str(record),
                           *([] if gpu is None else ["--gpu", str(gpu)])],
                          capture_output=True, text=True, timeout=300, env=nixl_env())
    assert done.returncode == 0, done.stderr
    data = json.loads(record.read_text())
    assert data["implementation"] == "nixl (UCX)" and data["nixl"]
    assert data["memory"] == ("host" if gpu is None else f"GPU {gpu} memory")
    assert (data["allocator"] is None) == (gpu is None) == (data["machine"]["gpu"] is None)
    assert [(r["page_size"], r["pages"]) for r in data["runs"]] == [(1024, 16), (4096, 16)]
    for row in data["runs"]:
        assert row["wrong_bytes"] == 0 and row["backend"] == "UCX" and row["gbps"] > 0
    assert "ucx: put:" in done.stdout  # UCX said which transport carried the WRITEs


@pytest.mark.skipif(HERE, reason="nixl is importable here")
def test_without_nixl_it_says_how_to_get_it():
    done = subprocess.run([sys.executable, str(SCRIPT), "--pages", "4"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    line, = done.stderr.strip().splitlines()
    assert "nixl is not importable" in line and "pip install nixl-cu13" in line


@pytest.mark.parametrize("args, said", [
    (["--page-size", "4Q"], "argument --page-size: not a size: '4Q' (e.g. 4096, 64K, 1M)"),
    (["--page-size", "4K,0"], "argument --page-size: not a size: '0'"),
    (["--pages", "0"], "argument --pages: not a count of pages: '0'"),
    (["--repeats", "0"], "--repeats takes 1 or more, --warmup 0 or more")])
def test_bad_input_is_one_line_before_anything_starts(args, said):
    done = subprocess.run([sys.executable, str(SCRIPT), *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"nixl_pages.py: error: {said}\n"


def test_a_python_without_this_repository_is_told_its_pythonpath():
    """nixl's own venv has not installed this repository: one line with the command."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", str(SCRIPT), "--pages", "4"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"nixl_pages.py: this repository's common/ is not importable by "
                           f"{sys.executable}: PYTHONPATH={ROOT} {sys.executable} {SCRIPT}\n")


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_a_gpu_that_cannot_be_used_is_one_line_before_anything_starts():
    """GPU 99: no such GPU where cupy or a CUDA torch is, no allocator elsewhere."""
    done = subprocess.run([NIXL_PYTHON, str(SCRIPT), "--gpu", "99", "--pages", "4"],
                          capture_output=True, text=True, timeout=120, env=nixl_env())
    assert done.returncode == 1 and done.stdout == "", done.stderr
    line, = done.stderr.strip().splitlines()
    assert line.startswith("nixl_pages.py: --gpu 99: "), line


@pytest.mark.skipif(WHY is not None, reason=WHY or "")
def test_transfer_bench_asks_nixl_for_its_own_gpu_memory(capsys):
    """transfer_bench --gpu N --nixl PYTHON: NIXL's pages in GPU N too, not in host memory
    (GPU 99 is refused, so NIXL's figure is not measured rather than taken from DRAM)."""
    import argparse

    from scripts import transfer_bench
    args = argparse.Namespace(sizes=[4096], counts=[4], repeats=1, gpu=99)
    assert transfer_bench.nixl(NIXL_PYTHON, args, 120) is None
    assert "nixl: not measured: nixl_pages.py: --gpu 99: " in capsys.readouterr().out

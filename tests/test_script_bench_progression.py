"""The benchmark scripts: what a run needs is checked before anything runs, and what was
measured before a failure is written, not thrown away."""
import importlib.util
import json
import subprocess
import sys

import pytest

from common.chapter_pair import ROOT, local_env

SCRIPTS = {"progression": ["--chapters", "9"], "bench": ["--chapters", "7"]}
QUICK = ["-p", "shm", "--sizes", "4K", "--repeats", "1", "--bytes", "1M", "--label", "test"]


def script(name, tmp_path, prefix, *args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / f"{name}.py"), *QUICK,
                           "--results", str(tmp_path / "results"), *SCRIPTS[name], *args],
                          capture_output=True, text=True, timeout=300,
                          env=local_env({"FABTESTS_PREFIX": str(prefix)}))


def fake_fi_rma_bw(tmp_path):
    """A libfabric prefix whose fi_rma_bw fails, as a broken build would."""
    bin_dir = tmp_path / "prefix" / "bin"
    bin_dir.mkdir(parents=True)
    tool = bin_dir / "fi_rma_bw"
    tool.write_text("#!/bin/sh\necho 'fi_rma_bw: broken on purpose' >&2\nexit 1\n")
    tool.chmod(0o755)
    return bin_dir.parent


@pytest.mark.parametrize("name", SCRIPTS)
def test_missing_fi_rma_bw_is_said_before_any_run(name, tmp_path):
    done = script(name, tmp_path, tmp_path / "nothing-here")
    assert done.returncode == 1
    assert done.stdout == ""  # no chapter ran
    line, = done.stderr.strip().splitlines()
    assert "fi_rma_bw not found" in line and "scripts/build_libfabric.sh" in line
    assert not (tmp_path / "results").exists()


@pytest.mark.long
@pytest.mark.parametrize("name", SCRIPTS)
def test_a_later_failure_keeps_what_was_measured(name, tmp_path):
    done = script(name, tmp_path, fake_fi_rma_bw(tmp_path))
    assert done.returncode == 1
    assert "broken on purpose" in done.stderr and "what was measured before it is written" \
        in done.stderr
    folder = "progression" if name == "progression" else "07_queue"
    data = json.loads((tmp_path / "results" / folder / "test-shm-host.json").read_text())
    row, = data["runs"]
    assert row["tool"].startswith("chapter 0") and row["median_gbps"] > 0
    assert not (tmp_path / "results" / "baselines").exists()


@pytest.mark.long
@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
@pytest.mark.parametrize("name", SCRIPTS)
def test_gpus_without_cupy_is_one_line(name, tmp_path):
    done = script(name, tmp_path, fake_fi_rma_bw(tmp_path), "--gpus", "0,1")
    assert done.returncode == 1 and done.stdout == ""
    line, = done.stderr.strip().splitlines()
    assert "--gpus needs cupy" in line and "pip install" in line


@pytest.mark.parametrize("change,counts", [({}, True), ({"libfabric": "another"}, False),
                                           ({"provider": "tcp"}, False), ({"cores": 999}, False)])
def test_a_baseline_counts_only_for_this_machine_provider_and_libfabric(change, counts, tmp_path,
                                                                        monkeypatch):
    from common import bench
    import common.fabric as fi
    here = bench.machine()
    major, minor = fi.version()
    record = {"provider": "shm", "memory": "host", "libfabric": f"{major}.{minor}.0",
              "machine": dict(here), "runs": [{"tool": "fi_rma_bw -o write", "size": 4096,
                                               "median_gbps": 12.5}]}
    if "libfabric" in change:
        record["libfabric"] = f"{major + 1}.{minor}.0"
    record["provider"] = change.get("provider", "shm")
    record["machine"]["cores"] = change.get("cores", here["cores"])
    (tmp_path / "baselines").mkdir()
    (tmp_path / "baselines" / "box-shm-host.json").write_text(json.dumps(record))
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "BASELINES", tmp_path / "baselines")
    found = bench.baseline("shm", "host", 4096, here)
    assert (found is not None) is counts
    if not counts:
        gbps, why = bench.limit([], "shm", "host", 4096, here)
        assert gbps is None and "scripts/baseline.py -p shm --sizes 4096" in why

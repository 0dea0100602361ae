"""Every notebook runs top to bottom on the results committed in results/, and with runs
of the reader's own in results/runs/ beside them (absent in a fresh clone)."""
import json
import shutil
from pathlib import Path

import nbclient
import nbformat
import pytest

from common.model import journey

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
READ_RUNS = ["07_queue", "07_to_11", "journey", "16_17_moe",
             "19_weight_update"]  # what_if: the model alone


def execute(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    return "".join(o.get("text", "") for o in outputs)


def test_there_is_a_notebook():
    assert NOTEBOOKS


@pytest.mark.long
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, monkeypatch):
    execute(path, monkeypatch)


def a_run(chapter, page_size, **more):
    """A record as a chapter's --json writes it (common/bench.py: record)."""
    return {"chapter": chapter, "provider": "shm", "memory": "host", "libfabric": "1.17",
            "machine": {"host": "laptop", "cpu": "Some CPU", "cores": 4, "gpu": None},
            "date": "2026-12-01T00:00:00+00:00", "page_size": page_size, "gbps": 12.5,
            "mpps": 0.02, "limit_gbps": 25.0, "limit": "fi_rma_bw here", "percent_of_limit": 50.0,
            **more}


@pytest.fixture
def readers_tree(tmp_path):
    """A copy of notebooks/ and results/ with runs of the reader's own, and a broken file."""
    for folder in ("notebooks", "results"):
        shutil.copytree(ROOT / folder, tmp_path / folder,
                        ignore=shutil.ignore_patterns("runs", "*.png"))
    (tmp_path / "common").symlink_to(ROOT / "common")
    runs = tmp_path / "results" / "runs"
    runs.mkdir()
    (runs / "07_queue-shm-host-65536-1.json").write_text(json.dumps(a_run("07_queue", 65536)))
    (runs / "09_multinet-shm-host-4nics-65536-1.json").write_text(
        json.dumps(a_run("09_multinet", 65536, percent_of_limit=None, limit=None)))
    moe = json.loads((ROOT / "results" / "16_moe" / "vm-2core-cpu-2ranks-1node.json").read_text())
    (runs / "16_moe-cpu-2ranks-1.json").write_text(json.dumps(moe))
    update = json.loads((ROOT / "results" / "19_weight_update" /
                         "h200-qwen3-30b-a3b-6layers-4to2.json").read_text())
    (runs / "19_weight_update-qwen3-30b-a3b-4to2-1.json").write_text(
        json.dumps({**update, "date": "2026-12-01T12:00:00+00:00"}))
    (runs / "broken.json").write_text("{")
    return tmp_path


def test_the_readers_runs_are_read_and_broken_ones_skipped(readers_tree):
    mine = journey.yours(readers_tree / "results")
    assert [r["chapter"] for r in mine] == ["16", "07", "09", "19"]  # oldest first


@pytest.mark.parametrize("state", ["absent", "empty"])
def test_no_runs_of_the_reader_is_none(tmp_path, state):
    if state == "empty":
        (tmp_path / "runs").mkdir()
    assert journey.yours(tmp_path) == []


@pytest.mark.long
@pytest.mark.parametrize("name", READ_RUNS)
def test_notebook_shows_the_readers_runs(readers_tree, name, monkeypatch):
    text = execute(readers_tree / "notebooks" / f"{name}.ipynb", monkeypatch)
    assert "yours" in text and "no run" not in text and "none in results/runs" not in text

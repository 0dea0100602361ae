"""What a results file keeps: no folder of the machine it ran on; a chapter's record, the
figure of its lesson and both sides' flags as data."""
import ast
import json
import re
from pathlib import Path

import pytest

from common import records
from common.chapter_pair import chapter_path, run_pair

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_absolute_paths_are_kept_by_their_last_part_only():
    argv = ["-p", "shm", "--nixl", "/opt/venvs/nixl/bin/python", "--json", "/srv/out/x.json",
            "--json=/tmp/a/b.json", "rel/dir/file.json", "--sizes", "4K/8K", "~/here"]
    assert records.arguments(argv) == ["-p", "shm", "--nixl", "python", "--json", "x.json",
                                       "--json=b.json", "rel/dir/file.json", "--sizes", "4K/8K",
                                       "~/here"]


def test_no_results_file_names_a_folder_of_a_machine():
    read = 0  # files with a command line: none read would be no check at all
    for path in RESULTS.rglob("*.json"):
        data = json.loads(path.read_text())
        args = data.get("args", [])
        if isinstance(args, list) and isinstance(data.get("server_args"), dict):
            args = args + list(data["server_args"].values())
        if isinstance(args, list) and args:
            read += 1
            named = [a for a in args if isinstance(a, str) and re.search(r"(^|=)/\w", a)]
            assert not named, f"{path.relative_to(RESULTS)}: {named}"
    assert read >= 10, f"only {read} files under results/ keep a command line"


# Chapters whose server writes a --json record of its run, and a short run of each.
WRITES_RECORDS = {7: ["--iters", "300", "--page-size", "64K", "--buffer-size", "4M",
                      "--pages", "0-63"]}
WRITES_RECORDS.update({n: ["--groups", "2", "--nics-per-gpu", "2", "--page-size", "4K",
                           "--buffer-size", "1M", "--pages", "0-63", "--iters", "2000"]
                       for n in range(9, 16)})


@pytest.mark.long
@pytest.mark.parametrize("number", sorted(WRITES_RECORDS))
def test_a_record_holds_its_chapters_lesson_figure_and_both_sides_flags(number, tmp_path):
    """The LESSON of each chapter that the tour runs and that writes a record names the
    record's field of its figure ("field"), and the record holds it; the server's flags
    and the client's (what its CONNECT carried) are data."""
    lesson = chapter_lesson(number)
    out = tmp_path / "run.json"
    flags = WRITES_RECORDS[number]
    pair = run_pair(number, "shm", ["--clients", "1", "--json", str(out)], [flags])
    assert pair.ok, pair
    record = json.loads(out.read_text())
    assert record["lesson"] == lesson["field"] and record[lesson["field"]] is not None
    assert record["server_args"]["json"] == "run.json" and record["server_args"]["clients"] == 1
    assert "address" not in record["server_args"] and "page_size" not in record["server_args"]
    assert record["client_args"]["page_size"] == (64 << 10 if number == 7 else 4096)
    assert record["client_args"]["pages"] == "0-63" and record["provider"] == "shm"
    if number >= 9:
        assert (record["client_args"]["groups"], record["client_args"]["nics_per_gpu"]) == (2, 2)
        assert record["nics"] == 4 and sum(record["writes_per_nic"]) == 2000
        assert record["workers"] == (2 if number >= 11 else 1)
    if number >= 10:
        assert len(record["first_write_ms"]) == 4 and record["first_vs_warm"] > 0


def chapter_lesson(number):
    """The chapter's LESSON as its file declares it; a chapter without one fails here."""
    path = chapter_path(number)
    found = [node.value for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LESSON"]
    assert found, f"{path.name} declares no LESSON"
    return ast.literal_eval(found[0])


def test_every_chapter_the_tour_measures_is_tested_for_its_record():
    from scripts import tour
    measured = {int(p.name[:2]) for p in chapter_path(3).parent.glob("[0-9][0-9]_*.py")
                if int(p.name[:2]) not in tour.CHECKS}
    assert measured <= set(WRITES_RECORDS)

"""What a results file keeps of the command line: no folder of the machine it ran on."""
import json
import re
from pathlib import Path

from common import records

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
        args = json.loads(path.read_text()).get("args", [])
        if isinstance(args, list) and args:
            read += 1
            named = [a for a in args if isinstance(a, str) and re.search(r"(^|=)/\w", a)]
            assert not named, f"{path.relative_to(RESULTS)}: {named}"
    assert read >= 10, f"only {read} files under results/ keep a command line"

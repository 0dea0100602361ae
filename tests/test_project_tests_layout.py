"""tests/ as tests/README.md lays it out: every test file named by its pattern, and each
chapter's row naming the files that test it."""
import re

from common.chapter_pair import ROOT

TESTS = ROOT / "tests"
PACKAGES = {p.name for p in (ROOT / "common").iterdir() if p.is_dir() and "_" not in p.name[:1]}
MODULES = {p.stem for p in (ROOT / "common").glob("*.py")}


def rows():
    """chapter -> the files its row of the README's table names."""
    table = {}
    for line in (TESTS / "README.md").read_text().splitlines():
        if m := re.match(r"\| (\d\d[^|]*) \| (`test_.*) \|$", line):
            first, *rest = re.findall(r"\d\d", m[1])
            last = rest[-1] if " to " in m[1] else first
            named = set(re.findall(r"`(test_\w+\.py)`", m[2]))
            for n in [*range(int(first), int(last) + 1), *map(int, rest)]:
                table[f"{n:02d}"] = named
    return table


def test_every_test_file_is_named_by_the_pattern():
    for path in TESTS.glob("test_*.py"):
        what = path.stem.split("_")[1]
        assert (re.fullmatch(r"\d\d", what) or what in ("script", "support", "project")
                or what in PACKAGES or what in MODULES
                or "_".join(path.stem.split("_")[1:3]) in MODULES), \
            f"{path.name}: say a chapter, a script, a module of common/, support or project"


def test_each_chapter_row_names_every_file_that_tests_it():
    table = rows()
    chapters = sorted({p.name[:2] for p in (ROOT / "chapters").glob("[0-9][0-9]_*.py")})
    assert sorted(table) == chapters
    for path in TESTS.glob("test_[0-9][0-9]_*.py"):
        first, last = re.match(r"test_(\d\d)(?:_(\d\d))?_", path.name).groups()
        covered = [c for c in chapters if first <= c <= (last or first)]
        assert any(path.name in table[c] for c in covered), f"{path.name}: in no chapter's row"
    for chapter, named in table.items():
        for name in named:
            assert (TESTS / name).exists(), f"chapter {chapter}'s row names {name}: no such file"

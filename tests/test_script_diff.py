"""scripts/diff.sh: each chapter against the chapter it builds on, docstrings left out."""
import re
import subprocess
from pathlib import Path

import pytest

DIFF = Path(__file__).resolve().parents[1] / "scripts" / "diff.sh"


def diff(*args):
    return subprocess.run(["bash", str(DIFF), *args], capture_output=True, text=True, timeout=60)


def files(out):
    """(old, new) per file shown, in order; old is None for a new file."""
    shown = re.findall(r"^--- (\S+)\n\+\+\+ b/(\S+)$", out, re.M)
    return [(None if old == "/dev/null" else old.removeprefix("a/"), new) for old, new in shown]


@pytest.mark.parametrize("chapter,expected", [
    ("05", [("chapters/04_hello.py", "chapters/05_reverse.py")]),
    ("08", [(None, "chapters/08_topo.py"), (None, "common/engine/topo.py")]),
    ("09", [("chapters/07_queue.py", "common/engine/multinet.py"),
            (None, "chapters/09_multinet.py")]),
    ("13", [("chapters/12_pin.c", "chapters/13_shard.c"),
            ("chapters/12_pin.py", "chapters/13_shard.py"), (None, "common/engine/shards.py")]),
])
def test_each_chapter_against_its_parent(chapter, expected):
    done = diff(chapter)
    assert done.returncode == 0, done.stderr
    assert files(done.stdout) == expected


def test_sixteen_builds_on_seven_and_its_c_follows_its_python():
    assert files(diff("16").stdout) == [("chapters/07_queue.py", "chapters/16_moe.py"),
                                        (None, "chapters/16_moe.c")]


def test_seventeen_shows_its_kernels_then_what_they_took_from_sixteen():
    assert files(diff("17").stdout) == [(None, "chapters/17_gpu_driven.cu"),
                                        ("chapters/16_moe.py", "chapters/17_gpu_driven.py")]


def test_where_the_lesson_is_c_the_c_comes_first():
    shown = files(diff("11").stdout)
    assert shown[0] == (None, "chapters/11_multithread.c")
    assert shown.index((None, "common/engine/lane.h")) < shown.index(
        ("chapters/10_warmup.py", "chapters/11_multithread.py"))


def test_unchanged_code_is_said_in_one_line():
    out = diff("12").stdout
    assert "# chapters/12_pin.c: the code of chapters/11_multithread.c, unchanged" in out


def test_two_chapters_are_compared_directly():
    assert files(diff("07", "09").stdout) == [("chapters/07_queue.py", "chapters/09_multinet.py")]


@pytest.mark.parametrize("chapter", ["05", "09", "12", "15"])
def test_docstrings_only_with_all(chapter):
    # Every chapter's docstring says what it teaches; the C files' leading comments too.
    lean, full = diff(chapter).stdout, diff("--all", chapter).stdout
    assert "What you will learn" not in lean and '"""' not in lean
    assert "What you will learn" in full
    assert len(full.splitlines()) > len(lean.splitlines())


@pytest.mark.parametrize("args,pattern", [
    (["99"], "no chapter 99"),
    (["abc"], "a chapter is a number such as 05, not 'abc'"),
    (["05", "98"], "no chapter 98"),
    ([], "usage"),
    (["1", "2", "3"], "usage"),
])
def test_bad_chapter_is_one_line_and_exit_2(args, pattern):
    done = diff(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and pattern in lines[0], done.stderr

"""scripts/diff.sh: what it prints for a chapter is its lesson: the lines the series says
the chapter changes, added and taken away, the C first where the lesson is C, docstrings
left out unless --all; bad input in one line."""
import ast
import re
import subprocess

import pytest

from common.records import ROOT

DIFF = ROOT / "scripts" / "diff.sh"


def diff(*args):
    return subprocess.run(["bash", str(DIFF), *args], capture_output=True, text=True, timeout=60)


def shown(out):
    """{file shown (its path in the repository): (lines added, lines removed)}, in order."""
    files, current = {}, None
    for line in out.splitlines():
        if line.startswith("+++ b/"):
            current = files.setdefault(line[len("+++ b/"):], ([], []))
        elif current is not None and line[:1] in "+-" and not line.startswith(("+++", "---")):
            current[0 if line[0] == "+" else 1].append(line[1:].strip())
    return files


def module_docstring(path):
    tree = ast.parse((ROOT / path).read_text())
    return ast.get_docstring(tree, clean=False) or ""


# (chapter, {file: (lines its lesson adds, lines it takes away)}): what the series says
# the chapter changes, as the diff must show it; each line whole, after its indentation.
LESSONS = [
    ("05", {"chapters/05_reverse.py": (["reply = TEXT + text[::-1].encode()"], [])}),
    ("07", {"chapters/07_queue.py": (
                ["queue = OpQueue(ep, cq, poller, slots=fi.in_flight(info))"], []),
            "common/engine/opqueue.py": (["class OpQueue:", "if rc == -lib.FI_EAGAIN:"], [])}),
    ("09", {"common/engine/multinet.py": (["class Lane:", "def serve(conn, head, request, "
                                                          "args, engine):"], []),
            "chapters/09_multinet.py": (
                ["def write_all(args, lanes, conn, page_size):",
                 'cli.run(lambda: multinet.run(__doc__, "09_multinet", write_all, '
                 'lesson=LESSON))'], [])}),
    ("10", {"chapters/10_warmup.py": (
                ["from common.engine.warmup import warm_up",
                 "compare = warm_up(lanes, conn)  # first contact, paid before the clock starts",
                 'cli.run(lambda: multinet.run(__doc__, "10_warmup", write_all, lesson=LESSON))'],
                ['cli.run(lambda: multinet.run(__doc__, "09_multinet", write_all, '
                 'lesson=LESSON))']),
            "common/engine/warmup.py": (["def warmed(engine):",
                                         "def warm_up(lanes, conn):"], [])}),
    ("13", {"chapters/13_shard.c": (
                ["struct counter {            // one worker's count of completed WRITEs, "
                 "alone on its cache"],
                ["__atomic_add_fetch((uint64_t *)total, (uint64_t)rc, __ATOMIC_RELAXED);"])}),
    ("15", {"chapters/15_lazy.c": (["static int enqueue(struct lane *l, unsigned batch)"], [])}),
    ("16", {"chapters/16_moe.py": (["class AllToAll(Stages):"], []),
            "common/moe/proxy.c": (["int m16_proxy_run(struct m16_proxy *p)"], [])}),
]


@pytest.mark.parametrize("chapter,lesson", LESSONS, ids=[c for c, _ in LESSONS])
def test_a_chapter_shows_the_lines_of_its_lesson(chapter, lesson):
    done = diff(chapter)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    files = shown(done.stdout)
    for path, (added, removed) in lesson.items():
        assert path in files, f"diff.sh {chapter} shows {list(files)}, not {path}"
        assert [line for line in added if line not in files[path][0]] == [], path
        assert [line for line in removed if line not in files[path][1]] == [], path


@pytest.mark.parametrize("chapter", ["05", "07", "10", "13"])
def test_docstrings_are_left_out_unless_all(chapter):
    """The first line of every Python file's docstring the diff shows (the chapter's title,
    a new module's summary) is not in it, and is with --all, as an added line."""
    lean, full = diff(chapter), diff("--all", chapter)
    assert lean.returncode == full.returncode == 0
    assert '"""' not in lean.stdout
    python = [path for path in shown(lean.stdout) if path.endswith(".py")]
    assert python and python == [path for path in shown(full.stdout) if path.endswith(".py")]
    for path in python:
        first = module_docstring(path).strip().splitlines()[0].strip()
        assert first and first not in lean.stdout, path
        assert first in shown(full.stdout)[path][0] or f'"""{first}' in \
            shown(full.stdout)[path][0], path


def test_where_the_lesson_is_c_the_c_comes_first():
    for chapter in ("11", "13", "15"):
        files = list(shown(diff(chapter).stdout))
        first_python = next(i for i, path in enumerate(files) if path.endswith(".py"))
        assert files[0].endswith((".c", ".h")) and first_python > 0, (chapter, files)
    files = list(shown(diff("17").stdout))
    assert files[0] == "chapters/17_gpu_driven.cu"
    assert any("__global__" in line for line in shown(diff("17").stdout)[files[0]][0])


@pytest.mark.parametrize("chapter", ["04", "09", "16", "18"])
def test_a_chapter_that_stands_alone_is_shown_whole_and_says_so(chapter):
    """PARENT "-": every file is new, nothing of another chapter taken away."""
    done = diff(chapter)
    files = shown(done.stdout)
    assert done.stdout.startswith(f"# {chapter} stands alone"), done.stdout[:200]
    assert files and all(not removed for _, removed in files.values()), list(files)
    assert done.stdout.count("--- /dev/null") == len(files)


def test_07_is_shown_against_06():
    """The op queue takes the place of 06's wait for each WRITE: both sides of that show."""
    done = diff("07")
    assert done.stdout.startswith("# 07 against 06, the chapter it builds on\n")
    files = shown(done.stdout)
    assert "--- a/chapters/06_write.py\n+++ b/chapters/07_queue.py\n" in done.stdout
    assert 'storage = ffi.new("struct fi_context2[]", npages)  # one context per WRITE in ' \
           'flight' in files["chapters/07_queue.py"][1]


def stand_alone_in(text, start, end):
    """The chapters named between `start` and `end` of `text`, after the last ';' there."""
    part = text[text.index(start):text.index(end, text.index(start))]
    return set(re.findall(r"\b\d\d\b", part.rsplit(";", 1)[-1]))


def test_readme_names_the_chapters_diff_shows_whole():
    """README's "Start here" lists the chapters PARENT has as "-", no more, no fewer."""
    parents = re.search(r"declare -A PARENT=\((.*?)\)", DIFF.read_text())[1]
    alone = set(re.findall(r"\[(\d\d)\]=-", parents))
    readme = (ROOT / "README.md").read_text()
    assert alone and stand_alone_in(readme, "`scripts/diff.sh NN`", "shown whole") == alone


def test_unchanged_code_is_said_in_one_line():
    out = diff("12").stdout
    assert "# chapters/12_pin.c: the code of chapters/11_multithread.c, unchanged" in out


def test_two_chapters_are_compared_directly():
    done = diff("07", "09")
    assert "--- a/chapters/07_queue.py\n+++ b/chapters/09_multinet.py\n" in done.stdout
    assert list(shown(done.stdout)) == ["chapters/09_multinet.py"]


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

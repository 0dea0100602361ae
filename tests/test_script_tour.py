"""scripts/tour.py: every chapter declares a LESSON the tour can judge (none, or one it
cannot judge, is refused by name); the flags the tour gives a chapter are flags the chapter
takes; a measured figure's pattern finds the figure in the chapter's transcripts
(results/NN_name/README.md); the verdicts; and the quick checks on real runs of their
chapters."""
import functools
import re
import shlex
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import common.fabric as fi
from common import gpu_ready
from common.chapter_pair import ROOT, Pair, Run, chapter_path, local_env
from scripts import tour
from tests.support.budget import Budget

CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))


@functools.cache
def flags_taken(number):
    """The flags chapter `number`'s --help lists."""
    done = Budget(60).run([sys.executable, str(chapter_path(number)), "--help"],
                          env=local_env())
    assert done.returncode == 0, done.stderr
    return frozenset(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", done.stdout))


def runs_of_a_check(number, declared, monkeypatch):
    """[(chapter, its arguments)] of each process CHECKS[number] starts on -p shm, from the
    tour's own code with nothing run: run_pair and run_one are stand-ins that fail."""
    started = []

    def pair(chapter, provider=None, server_args=(), client_args=((),), **_):
        sides = [["-p", provider] + list(server_args)] + \
            [["-p", provider] + list(args) for args in client_args]
        started.extend((int(chapter), side) for side in sides)
        return Pair(Run([]), [Run([], rc=1)])

    def run(args, *_, **__):
        args = [str(a) for a in args]
        at = next(i for i, a in enumerate(args) if Path(a).parent == ROOT / "chapters")
        started.append((int(Path(args[at]).name[:2]), args[at + 1:]))
        return SimpleNamespace(returncode=1, stdout="", stderr="")

    monkeypatch.setattr(tour, "run_pair", pair)
    monkeypatch.setattr(tour, "run_one", run)
    monkeypatch.setattr(gpu_ready, "why_not", lambda: None)  # 17 as on a GPU machine
    ok, said = tour.CHECKS[number]("shm", declared)
    assert ok is False and said  # the stand-ins failed: the check says so
    return started


def runs_of_a_measure(number, declared):
    """[(chapter, its arguments)] of the server and client of each run the tour measures."""
    started = []
    for spec in filter(None, tour.specs(number, declared, "shm")):
        chapter, server, client, _ = spec
        started += [(chapter, ["--clients", "1", *server]), (chapter, list(client))]
    return started


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_chapter_declares_a_lesson_the_tour_can_judge(path, monkeypatch):
    number = int(path.name[:2])
    declared = tour.lesson(path)  # a ValueError where the tour could not judge it
    if number in tour.CHECKS:
        started = runs_of_a_check(number, declared, monkeypatch)
    else:
        started = runs_of_a_measure(number, declared)
        transcript = (ROOT / "results" / path.stem / "README.md").read_text()  # its runs
        pattern = tour.FIGURES[declared["figure"]][0]
        assert re.search(pattern, transcript), \
            f"{path.name}: the tour reads {declared['figure']!r} with {pattern!r}; " \
            "its transcript has no such line"
    assert any(chapter == number for chapter, _ in started)
    for chapter, args in started:
        unknown = [a.split("=")[0] for a in args if re.match(r"--?[A-Za-z]", a)
                   and a.split("=")[0] not in flags_taken(chapter)]
        assert not unknown, f"the tour runs chapter {chapter:02d} with {unknown}, " \
            f"which its --help does not list: {shlex.join(args)}"


def written(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(f'"""A chapter."""\n{text}\n')
    return path


MEASURED = "'figure': 'CPU per WRITE', 'client': '--iters 10'"


@pytest.mark.parametrize("name,text,says", [
    ("07_x.py", "import sys", "07_x.py: no LESSON"),
    ("07_x.py", "LESSON = dict(figure='refused')", "07_x.py: LESSON is not a literal"),
    ("07_x.py", "LESSON = ['refused']", "is not a dict with a 'figure'"),
    ("07_x.py", "LESSON = {'figure': 'check', 'shows': 'it'}", "figure 'check' is none the "
     "tour measures"),
    ("11_x.py", "LESSON = {'figure': 'CPU per WRITE', 'visible': {'at_most': 3}}",
     "needs the 'client' flags"),
    ("11_x.py", "LESSON = {" + MEASURED + "}", "needs one 'visible' rule"),
    ("11_x.py", "LESSON = {" + MEASURED + ", 'visible': {'at_most': 3, 'than': '10'}}",
     "needs one 'visible' rule"),
    ("11_x.py", "LESSON = {" + MEASURED + ", 'visible': {'than': '12', 'by': 2}}",
     "'than' names no chapter up to 11: '12'"),
    ("11_x.py", "LESSON = {" + MEASURED + ", 'visible': {'than': '10', 'by': 1}}",
     "'than' needs a factor 'by' above 1"),
    ("11_x.py", "LESSON = {" + MEASURED + ", 'visible': {'at_most': 'low'}}",
     "needs a number"),
    ("04_x.py", "LESSON = {'figure': 'hello'}", "needs figure 'check', or a 'visible' rule"),
    ("06_x.py", "LESSON = {'figure': 'wrong bytes', 'visible': {}}", "needs one 'visible' rule"),
    ("11_x.py", "LESSON = {" + MEASURED + ", 'visible': {'at_most': 3}, 'why_not': {'tcp': 3}}",
     "'why_not' of tcp needs a reason, or one per libfabric major version ({'2': ...})"),
    ("11_x.py", "LESSON = {" + MEASURED + ", 'visible': {'at_most': 3}, "
     "'why_not': {'tcp': {'2.x': 'slow'}}}", "'why_not' of tcp needs a reason, or one per"),
])
def test_a_missing_or_malformed_lesson_is_refused_by_name(tmp_path, name, text, says):
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        tour.lesson(written(tmp_path, name, text))
    assert str(refused.value).startswith(f"{name}: ")


def test_a_well_formed_lesson_is_read_as_declared(tmp_path):
    text = "LESSON = {" + MEASURED + ", 'visible': {'than': '11 --engine python', 'by': 1.5}}"
    assert tour.lesson(written(tmp_path, "11_x.py", text))["visible"]["by"] == 1.5


@pytest.mark.parametrize("number", [3, 4, 5, 6, 8])
def test_a_quick_check_passes_on_a_real_run_of_its_chapter(number):
    ok, said = tour.CHECKS[number]("shm", tour.lesson(chapter_path(number)))
    assert ok is True, said


LOWER = {"figure": "CPU per WRITE", "visible": {"than": "11", "by": 1.5}}


@pytest.mark.parametrize("mine,theirs,visible,why", [
    ([2.0, 2.1, 2.2], [5.0, 5.5, 6.0], True, "2.6x lower, each median beyond the other's range"),
    ([2.0, 2.1, 5.1], [5.0, 5.5, 6.0], True, "each median beyond"),  # one repeat in a burst
    ([2.0, 2.1, 6.5], [5.0, 5.5, 6.0], False, "but a median lies in the other's range"),
    ([2.0, 2.1, 2.2], [1.9, 5.5, 6.0], False, "but a median lies in the other's range"),
    ([4.0, 4.1, 4.2], [5.0, 5.5, 6.0], False, "less than 1.5x"),
    ([0.0, 0.0, 0.0], [5.0, 5.5, 6.0], True, "lower: 0.00 against 5.50, each median beyond"),
    ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], False, "1.00x lower, less than 1.5x"),  # none either side
])
def test_a_comparison_counts_only_beyond_the_noise(mine, theirs, visible, why):
    shown, said = tour.verdict(LOWER, mine, theirs)
    assert shown is visible and why in said


def test_higher_is_better_for_first_contact():
    lesson = {"figure": "first WRITE", "visible": {"at_least": 2}}
    assert tour.verdict(lesson, [300, 250, 400], None)[0]
    assert not tour.verdict(lesson, [300, 1.5, 400], None)[0]


def chapters_run_where(default, usable, forced=None, version=(1, 17)):
    """Which provider the tour runs each chapter on, given this host's and its libfabric."""
    return {int(p.name[:2]): tour.provider_for(tour.lesson(p), forced, default, usable,
                                               version)[0]
            for p in CHAPTERS}


def test_each_chapter_runs_where_its_lesson_moves_on_a_host_without_a_nic():
    """This VM: shm by default, tcp offered too; on 2 cores and libfabric 1.17 the lessons
    of 14 and 15 cannot show on shm but do on tcp, and those of 12 and 13 on neither."""
    where = chapters_run_where("shm", ["shm", "tcp;ofi_rxm", "udp;ofi_rxd"])
    on_tcp = {n for n, provider in where.items() if provider == "tcp"}
    assert on_tcp == {14, 15}
    assert {provider for n, provider in where.items() if n not in on_tcp} == {"shm"}


def test_on_libfabric_2_chapters_14_and_15_are_not_sent_to_tcp():
    """2.x's own tcp takes every WRITE (as chapter 07's LESSON says) and starts sending it
    inside its post: 15's figure, refused posts, and 14's, the CPU a batch saves, cannot
    move there, so both stay on the default and say why; for 1.x's tcp, under rxm, they
    give no such reason and go there (above)."""
    where = chapters_run_where("shm", ["shm", "tcp", "tcp;ofi_rxm"], version=(2, 1))
    assert where[14] == where[15] == "shm"
    for n in (14, 15):
        lesson, stem = tour.lesson(chapter_path(n)), chapter_path(n).stem
        said = tour.why_not(stem, lesson, "tcp", (2, 1))
        assert "2.x" in said and "gives no reason" not in said
        assert "gives no reason" in tour.why_not(stem, lesson, "tcp;ofi_rxm", (1, 17))


def test_a_chapter_whose_provider_is_not_here_runs_on_the_default():
    where = chapters_run_where("shm", ["shm"])
    assert set(where.values()) == {"shm"}
    lesson = {"why_not": {"shm": "..."}}
    assert tour.provider_for(lesson, None, "shm", ["shm"], (1, 17)) == (
        "shm", "the default; its lesson moves on no provider here")


def test_a_reason_of_one_libfabric_version_rules_out_that_version_only():
    lesson = {"why_not": {"shm": "...", "tcp": {"2": "2.x's tcp takes every WRITE"}}}
    assert tour.provider_for(lesson, None, "shm", ["shm", "tcp;ofi_rxm"], (1, 17))[0] == "tcp"
    assert tour.provider_for(lesson, None, "shm", ["shm", "tcp"], (2, 6))[0] == "shm"
    assert tour.reason(lesson, "tcp", (2, 6)) == "2.x's tcp takes every WRITE"
    assert tour.reason(lesson, "tcp;ofi_rxm", (1, 17)) is None
    assert tour.reason(lesson, "shm", (1, 17)) == tour.reason(lesson, "shm", (2, 6)) == "..."


def test_a_nic_s_provider_is_kept_where_no_chapter_rules_it_out():
    where = chapters_run_where("efa", ["efa", "shm", "tcp;ofi_rxm"])
    assert set(where.values()) == {"efa"}


def test_p_runs_every_chapter_on_one_provider():
    assert set(chapters_run_where("shm", ["shm", "tcp"], forced="tcp").values()) == {"tcp"}


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
@pytest.mark.parametrize("version", [(1, 17), (2, 6)], ids=["1.17", "2.6"])
def test_a_reason_is_printed_only_for_the_provider_it_ran_on(path, version):
    lesson = tour.lesson(path)
    reasons = {name: tour.reason(lesson, name, version) for name in lesson.get("why_not", {})}
    for provider in ("shm", "tcp;ofi_rxm", "efa", "verbs"):
        said = tour.why_not(path.stem, lesson, provider, version)
        assert said.startswith(f"{path.stem} on {tour.base(provider)}: ")
        mine = reasons.get(tour.base(provider))
        assert (mine in said) if mine else "gives no reason" in said
        assert not [other for name, other in reasons.items()
                    if name != tour.base(provider) and other and other != mine and other in said]


def test_reasons_name_providers_in_the_chapters_order():
    assert tour.PREFERENCE == fi.DEFAULT_PROVIDERS
    for path in CHAPTERS:
        assert set(tour.lesson(path).get("why_not", {})) <= set(tour.PREFERENCE), path.stem

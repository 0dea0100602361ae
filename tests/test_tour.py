"""The tour's verdicts and the chapters' LESSON declarations it reads (no chapter is run)."""
import pytest

import common.fabric as fi
from scripts import tour
from scripts.pair import ROOT

CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_every_chapter_declares_a_lesson_the_tour_can_judge(path):
    lesson = tour.lesson(path)
    number = int(path.name[:2])
    if number in tour.CHECKS:
        return
    assert lesson["figure"] in tour.FIGURES and lesson["client"]
    rule = lesson["visible"]
    assert {"at_least", "at_most", "than"} & set(rule)
    if "than" in rule:
        other = int(rule["than"].split()[0])
        assert other <= number and rule["by"] > 1
        assert any(p.name.startswith(f"{other:02d}_") for p in CHAPTERS)


LOWER = {"figure": "CPU per WRITE", "visible": {"than": "11", "by": 1.5}}


@pytest.mark.parametrize("mine,theirs,visible,why", [
    ([2.0, 2.1, 2.2], [5.0, 5.5, 6.0], True, "2.6x lower, every repeat apart"),
    ([2.0, 2.1, 5.1], [5.0, 5.5, 6.0], False, "but the repeats overlap"),
    ([4.0, 4.1, 4.2], [5.0, 5.5, 6.0], False, "less than 1.5x"),
    ([0.0, 0.0, 0.0], [5.0, 5.5, 6.0], True, "infx lower"),
])
def test_a_comparison_counts_only_beyond_the_noise(mine, theirs, visible, why):
    shown, said = tour.verdict(LOWER, mine, theirs)
    assert shown is visible and why in said


def test_higher_is_better_for_first_contact():
    lesson = {"figure": "first WRITE", "visible": {"at_least": 2}}
    assert tour.verdict(lesson, [300, 250, 400], None)[0]
    assert not tour.verdict(lesson, [300, 1.5, 400], None)[0]


def chapters_run_where(default, usable, forced=None):
    """Which provider the tour runs each chapter on, given this host's."""
    return {int(p.name[:2]): tour.provider_for(tour.lesson(p), forced, default, usable)[0]
            for p in CHAPTERS}


def test_each_chapter_runs_where_its_lesson_moves_on_a_host_without_a_nic():
    """This VM: shm by default, tcp offered too; on 2 cores and libfabric 1.17 the lessons
    of 14 and 15 cannot show on shm but do on tcp, and those of 12 and 13 on neither."""
    where = chapters_run_where("shm", ["shm", "tcp;ofi_rxm", "udp;ofi_rxd"])
    on_tcp = {n for n, provider in where.items() if provider == "tcp"}
    assert on_tcp == {14, 15}
    assert {provider for n, provider in where.items() if n not in on_tcp} == {"shm"}


def test_a_chapter_whose_provider_is_not_here_runs_on_the_default():
    where = chapters_run_where("shm", ["shm"])
    assert set(where.values()) == {"shm"}
    lesson = {"why_not": {"shm": "..."}}
    assert tour.provider_for(lesson, None, "shm", ["shm"]) == (
        "shm", "the default; its lesson moves on no provider here")


def test_a_nic_s_provider_is_kept_where_no_chapter_rules_it_out():
    where = chapters_run_where("efa", ["efa", "shm", "tcp;ofi_rxm"])
    assert set(where.values()) == {"efa"}


def test_p_runs_every_chapter_on_one_provider():
    assert set(chapters_run_where("shm", ["shm", "tcp"], forced="tcp").values()) == {"tcp"}


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_a_reason_is_printed_only_for_the_provider_it_ran_on(path):
    reasons = tour.lesson(path).get("why_not", {})
    for provider in ("shm", "tcp;ofi_rxm", "efa", "verbs"):
        said = tour.why_not(path.stem, tour.lesson(path), provider)
        assert said.startswith(f"{path.stem} on {tour.base(provider)}: ")
        mine = reasons.get(tour.base(provider))
        assert (mine in said) if mine else "gives no reason" in said
        assert not [other for name, other in reasons.items()
                    if name != tour.base(provider) and other != mine and other in said]


def test_reasons_name_providers_in_the_chapters_order():
    assert tour.PREFERENCE == fi.DEFAULT_PROVIDERS
    for path in CHAPTERS:
        assert set(tour.lesson(path).get("why_not", {})) <= set(tour.PREFERENCE), path.stem

"""The tour's verdicts and the chapters' LESSON declarations it reads (no chapter is run)."""
import pytest

from scripts import tour
from common.chapter_pair import ROOT

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

"""A test's waits come from one Budget (tests/support/budget.py): none outlasts the test's
own limit."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.budget import Budget

TESTS = Path(__file__).parent


def test_waits_granted_later_are_stretched_by_the_load_at_the_start(monkeypatch):
    """The load rising between the limit and a grant (180 s read at load 1, then a 60 s grace
    at 4) must not make the grace the longer one."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (2.0, 0.0, 0.0))
    budget = Budget(180)
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 0.0, 0.0))
    assert budget.grant(60) == 60 < budget.seconds == 180
    assert budget.left() <= budget.seconds


@pytest.mark.parametrize("seconds", [0, 180, 240])
def test_a_wait_as_long_as_the_test_is_refused(seconds):
    with pytest.raises(ValueError, match="does not fit in a test of 180 s"):
        Budget(180).grant(seconds)


def test_a_process_still_running_at_the_end_is_stopped_not_left():
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    with pytest.raises(subprocess.TimeoutExpired):
        Budget(0.1).run(sleeper)
    with subprocess.Popen(sleeper, stdout=subprocess.PIPE, text=True) as proc:
        # past Python's own start, where a Ctrl-C is Python's fatal error, not -2 (a suite
        # beside 4 CPU hogs: 0.1 s ran out in site's imports)
        assert proc.stdout.readline() == "up\n"
        with pytest.raises(subprocess.TimeoutExpired):
            Budget(0.1).communicate(proc)
        assert proc.returncode == -2  # Ctrl-C, as a launcher is stopped: it stops its ranks


def waits_outside_a_budget(tree):
    """Calls of patience() (read at the moment of the call, not at the test's start), and
    Budgets made when the module is imported (long before its tests run)."""
    found = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", getattr(node.func, "attr", None)) == "patience"]
    found += [node for top in tree.body if not isinstance(top, (ast.FunctionDef, ast.ClassDef))
              for node in ast.walk(top) if isinstance(node, ast.Call)
              and getattr(node.func, "id", None) == "Budget"]
    return [node.lineno for node in found]


@pytest.mark.parametrize("path", sorted(p for p in TESTS.rglob("*.py")
                                        if p.name not in ("budget.py", "test_patience.py")),
                         ids=lambda p: p.name)
def test_every_wait_in_the_tests_comes_from_a_budget(path):
    lines = waits_outside_a_budget(ast.parse(path.read_text()))
    assert not lines, f"{path.name}, lines {lines}: take the wait from a Budget " \
        "(tests/support/budget.py)"


def test_the_check_sees_a_limit_read_at_import_and_a_grace_read_later():
    unfixed = ("LIMIT = patience(180)\n"
               "def test_kill():\n"
               "    run(grace=patience(60), timeout=LIMIT)\n"
               "EARLY = Budget(10)\n")
    assert waits_outside_a_budget(ast.parse(unfixed)) == [1, 3, 4]

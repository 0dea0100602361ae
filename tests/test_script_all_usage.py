"""Every script in scripts/: it answers --help, and it takes what it shares with the other
scripts from common/, never from another script and never by changing sys.path (the
project is installed into .venv, so common/ imports as it is). Nor does any file of
tests/, the programs the tests start (tests/programs/stuck.py, ...) included, nor a notebook's
code cell; and a test file
(test_*.py) takes what it shares with others from a helper of tests/ (a name without
test_), never from another test file."""
import ast
import json
import sys

import pytest

from common.chapter_pair import ROOT, local_env
from tests.support.budget import Budget

SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
SHELL_SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))
TESTS = sorted((ROOT / "tests").rglob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NAMES = {path.stem for path in SCRIPTS}


def imported(tree):
    """The top-level names of every module the code imports, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]


def imported_test_files(tree):
    """The test files (tests.test_*) the code imports, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name.startswith("tests.test_"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tests":
            yield from (f"tests.{alias.name}" for alias in node.names
                        if alias.name.startswith("test_"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and \
                node.module.startswith("tests.test_"):
            yield node.module


def touches_sys_path(tree):
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and node.attr == "path" and getattr(node.value, "id", None) == "sys"]


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_a_script_imports_common_not_other_scripts(path):
    tree = ast.parse(path.read_text())
    assert touches_sys_path(tree) == [], f"{path.name} changes sys.path"
    others = sorted(set(imported(tree)) & (NAMES | {"scripts", "tests"}))
    assert others == [], f"{path.name} imports {others}: what scripts share is in common/"


@pytest.mark.parametrize("path", TESTS, ids=[p.stem for p in TESTS])
def test_a_test_leaves_sys_path_alone(path):
    assert touches_sys_path(ast.parse(path.read_text())) == [], f"{path.name} changes sys.path"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_leaves_sys_path_alone(path):
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert touches_sys_path(ast.parse(code)) == [], f"{path.name} changes sys.path"


@pytest.mark.parametrize("path", TESTS, ids=[p.stem for p in TESTS])
def test_a_test_imports_helpers_not_other_test_files(path):
    others = sorted(set(imported_test_files(ast.parse(path.read_text()))))
    assert others == [], f"{path.name} imports {others}: what tests share is in tests/support/"


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_a_script_answers_help(path):
    done = Budget(60).run([sys.executable, str(path), "--help"], env=local_env())
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=[p.stem for p in SHELL_SCRIPTS])
def test_a_shell_script_answers_help_and_refuses_what_it_does_not_take(path):
    """--help shows its header (setup and the build used to start on it); an argument it
    does not take is one line and exit 2, before anything runs."""
    done = Budget(60).run(["bash", str(path), "--help"], env=local_env())
    assert done.returncode == 0 and done.stdout.startswith("usage: bash scripts/"), done.stderr
    assert path.read_text().splitlines()[1].lstrip("# ") in done.stdout
    done = Budget(60).run(["bash", str(path), "--nonsense"], env=local_env())
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_checks_see_an_import_of_a_script_and_a_change_of_sys_path():
    tree = ast.parse("import sys\nsys.path.insert(0, 'x')\nfrom pair import run_pair\n"
                     "def f():\n    from scripts import baseline\n")
    assert touches_sys_path(tree) == [2]
    assert set(imported(tree)) & (NAMES | {"scripts"}) == {"pair", "scripts"}
    tree = ast.parse("import tests.test_a\nfrom tests import test_b\n"
                     "from tests.support import fake_info\nfrom tests.support.budget import "
                     "Budget\ndef f():\n    from tests.test_c import x\n")
    assert sorted(imported_test_files(tree)) == ["tests.test_a", "tests.test_b", "tests.test_c"]

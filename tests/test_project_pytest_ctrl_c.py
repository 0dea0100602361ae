"""Ctrl-C to pytest alone (not to its process group, as a terminal would) ends the chapters
the suite started within 2 s, nothing of theirs left in /dev/shm (tests/conftest.py)."""
import re
import signal
import subprocess
import sys
import time

import pytest

from common import shm_files
from common.chapter_pair import ROOT, local_env
from tests.support.budget import Budget


@pytest.mark.long  # a pytest of its own: seconds
def test_ctrl_c_to_pytest_ends_the_chapters_it_started():
    budget = Budget(60)
    suite = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                              "tests/programs/interrupted_suite.py"], cwd=ROOT, env=local_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
    out, found = "", None
    try:
        while not found and suite.poll() is None and budget.left() > 0:
            out += suite.stdout.readline()
            found = re.search(r"server pid (\d+)", out)
        assert found, out
        server = int(found[1])
        signalled = time.monotonic()
        suite.send_signal(signal.SIGINT)
        out += suite.communicate(timeout=budget.left())[0]
        took = time.monotonic() - signalled
        assert took < budget.grant(2), f"pytest took {took:.1f} s to end:\n{out}"
        assert shm_files.ended(server), out
        assert not shm_files.regions(server)
    finally:
        if suite.poll() is None:
            suite.kill()
            suite.communicate()

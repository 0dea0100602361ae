"""What the bad-input tests share: a chapter run within LIMIT seconds, the check that it
failed in one line on stderr with no traceback, and addresses no one answers at.

tests/test_project_bad_input.py holds the cases common to chapters 03-05 and the scripts; each
chapter's own bad input is tested beside the rest of the chapter's tests.
"""
import sys
import time

from common.chapter_pair import chapter_path, local_env
from tests.support.budget import Budget

LIMIT = 10  # seconds, for every case, on a quiet machine
SHM_DEAD = b"fi_shm://999999999:0:0\0".hex()          # a process that does not exist
TCP_DEAD = "02000001" + "7f000001" + "00" * 8           # 127.0.0.1 port 1: nobody there


def run(chapter, *args):
    """The chapter's exit within LIMIT seconds (TimeoutExpired past them), and how long it took."""
    start = time.monotonic()
    done = Budget(LIMIT).run([sys.executable, str(chapter_path(chapter)), *args], env=local_env())
    return done, time.monotonic() - start


def assert_one_line_error(done, pattern):
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert pattern in lines[0], lines[0]

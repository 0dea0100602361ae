"""Ctrl-C on a server of chapters 07, 09 and 10 (the op queue in Python) while WRITEs stream
to its client: exit 130 at the first press, in one line, wherever the interrupt lands."""
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.chapter_pair import ADDRESS, chapter_path, local_env
from tests.support.budget import Budget

CHAPTERS = [7, 9, 10]
SMALL = ["--buffer-size", "4M", "--pages", "0-63"]  # 64 pages of 64 KiB
INTERRUPTED = Path(__file__).parent / "programs" / "interrupted_server.py"
STARTED = 20  # seconds, quiet machine, for a process to print its first lines (numpy's import)
TIMEOUT = 10  # seconds, quiet machine: both sides' --timeout
# Both sides started, a second of WRITEs, the server's end (twice its --timeout), a clean-up.
LIMIT = 2 * STARTED + 1 + 2 * TIMEOUT + TIMEOUT


def started(args, until, within):
    """A process of ours, once it has printed a line matching `until` (looked for during
    `within` seconds), and what it printed."""
    proc = subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=local_env())
    out, deadline = "", time.monotonic() + within
    while not re.search(until, out, re.MULTILINE) and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        out += line
    if not re.search(until, out, re.MULTILINE):
        proc.kill()
        pytest.fail(f"no '{until}' from {args}: {out}{proc.communicate()[1]}")
    return proc, out


def interrupted_mid_run(chapter, server, interrupt=None):
    """Run `server` (the command line before the chapter's own flags) with a client streaming
    WRITEs into it, Ctrl-C it after a second unless `interrupt` is None (it interrupts itself),
    and return (exit code, stderr, seconds from the client's start to the exit, the server's
    --timeout). The server may take twice its --timeout to end, so that a drain waiting in
    vain for its peer shows as such."""
    budget = Budget(LIMIT)
    timeout, within = budget.grant(TIMEOUT), budget.grant(STARTED)
    proc, out = started([*server, chapter_path(chapter), "-p", "shm", "--timeout", timeout],
                        ADDRESS.pattern, within)
    client = None
    try:
        client, _ = started([chapter_path(chapter), "-p", "shm", ADDRESS.search(out)[1],
                             "--iters", 100_000_000, *SMALL, "--timeout", timeout], "^memory:",
                            within)
        sent = time.monotonic()  # the earliest an interrupt injected mid-run can come
        time.sleep(1)
        if interrupt:
            proc.send_signal(interrupt)
        try:
            _, err = proc.communicate(timeout=2 * timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server still runs {2 * timeout:.0f} s after the interrupt")
        return proc.returncode, err, time.monotonic() - sent, timeout
    finally:
        for p in (proc, client):  # Ctrl-C first: a process killed leaves its shm regions
            if p and p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.communicate()


def assert_interrupted(chapter, rc, err, elapsed, timeout):
    assert rc == 130, err
    assert err.strip() == f"{chapter_path(chapter).name}: interrupted, resources closed", err
    assert elapsed < timeout, f"{elapsed:.1f} s to end: it waited for its peer"


@pytest.mark.long
@pytest.mark.parametrize("chapter", CHAPTERS)
@pytest.mark.parametrize("call,after", [("fi_writemsg", 2000), ("fi_cq_read", 500)])
def test_interrupt_just_after_a_call_ends_the_server(chapter, call, after):
    """The interrupt right after a post (before the queue marks its context busy) or a CQ
    read (before it takes the completions it read) once ended in "a second completion",
    reported as the client's failure, or in a drain waiting for completions already read."""
    assert_interrupted(chapter, *interrupted_mid_run(chapter, [INTERRUPTED, call, after]))


@pytest.mark.long
@pytest.mark.parametrize("chapter", CHAPTERS)
def test_an_error_in_the_clean_up_does_not_replace_the_interrupt(chapter):
    server = [INTERRUPTED, "fi_writemsg", 2000, "--failing-close"]
    assert_interrupted(chapter, *interrupted_mid_run(chapter, server))


@pytest.mark.long
@pytest.mark.parametrize("chapter", CHAPTERS)
@pytest.mark.parametrize("attempt", range(3))
def test_ctrl_c_mid_run_ends_the_server(chapter, attempt):
    assert_interrupted(chapter, *interrupted_mid_run(chapter, [], signal.SIGINT))

"""Bad input: one clear line on stderr, a non-zero exit within 10 s, no traceback."""
import signal
import subprocess
import sys

import pytest

from common.chapter_pair import ADDRESS, chapter_path, local_env
from tests.support import fake_info
from tests.support.budget import Budget
from tests.support.one_line_errors import LIMIT, SHM_DEAD, TCP_DEAD, assert_one_line_error, run

@pytest.mark.parametrize("chapter", [4, 5])
@pytest.mark.parametrize("args,pattern", [
    (["zz"], "not a hex digit at position 0"),
    (["abc"], "hex digits"),
    (["-p", "tcp", "0011"], "addresses are 16 bytes; this one is 14 bytes too short"),
    (["-p", "shm", "0011"], "NUL-terminated strings"),
    (["-p", "nosuch"], "unknown provider 'nosuch'"),
    (["-p", "efa"], "provider 'efa' has no usable device here"),
    (["-p", "shm", SHM_DEAD, "x" * 5000], "buffer holds"),
    (["--timeout", "soon"], "--timeout: expected seconds, 0 or more"),
    (["--bogus"], "unrecognized arguments"),
])
def test_rejected_with_one_line(chapter, args, pattern):
    if "efa" in args:
        fake_info.skip_where_present("efa")
    done, _ = run(chapter, *args)
    assert_one_line_error(done, pattern)
    assert done.returncode in (1, 2)


@pytest.mark.long
@pytest.mark.parametrize("chapter", [4, 5])
@pytest.mark.parametrize("provider,address", [("shm", SHM_DEAD), ("tcp", TCP_DEAD)])
def test_client_without_server_gives_up(chapter, provider, address):
    done, _ = run(chapter, "-p", provider, "--timeout", "2", address, "anyone?")
    assert_one_line_error(done, "error:")
    assert done.returncode == 1


@pytest.mark.long
@pytest.mark.parametrize("chapter", [6, 7, 13])
def test_a_buffer_too_big_for_memory_is_one_line(chapter):
    done, _ = run(chapter, "-p", "shm", SHM_DEAD, "--buffer-size", "1048576G", "--pages", "0-63")
    assert_one_line_error(done, f"cannot allocate {1 << 50} bytes of host memory")


@pytest.mark.long
def test_03_rejects_unknown_capability_and_provider():
    assert_one_line_error(run(3, "--caps", "FI_BOGUS")[0], "unknown capability 'FI_BOGUS'")
    assert_one_line_error(run(3, "-p", "nosuch")[0], "unknown provider")


@pytest.mark.long
@pytest.mark.parametrize("chapter", [4, 5])
def test_server_ctrl_c_is_a_clean_exit(chapter, provider):
    proc = subprocess.Popen([sys.executable, str(chapter_path(chapter)), "-p", provider],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=local_env())
    try:
        out, budget = "", Budget(LIMIT)
        while not ADDRESS.search(out) and budget.left() > 0:
            out += proc.stdout.readline()
        assert ADDRESS.search(out), out
        proc.send_signal(signal.SIGINT)
        _, err = budget.communicate(proc)
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert err.strip() == f"{chapter_path(chapter).name}: interrupted, resources closed"


@pytest.mark.parametrize("args,pattern", [(["04", "--limit", "0"], "not a number of seconds"),
                                          (["04", "--nope"], "unrecognized arguments")])
def test_pair_refuses_bad_flags_in_one_line(args, pattern):
    done = Budget(LIMIT).run([sys.executable, str(chapter_path(4).parents[1] / "scripts" /
                              "pair.py"), *args], env=local_env())
    assert_one_line_error(done, pattern)


@pytest.mark.parametrize("script,args,pattern", [
    ("tour.py", ["--repeats", "1"], "invalid choice: 1"),
    ("baseline.py", ["--sizes", "3X"], "not a size: '3X'"),
    ("bench.py", ["--sizes", "0X"], "not a size: '0X'"),
    ("progression.py", ["--chapters", "99"], "--chapters takes chapter numbers"),
    ("atomic_bench.py", ["--threads", "x"], "not a comma-separated list of integers"),
    ("calibrate.py", ["--nope"], "unrecognized arguments"),
    ("journey.py", ["--nope"], "unrecognized arguments")])
def test_the_scripts_refuse_bad_flags_in_one_line(script, args, pattern):
    """argparse's own parser says its usage first: two lines (common/usage.Parser: one)."""
    done = Budget(LIMIT).run([sys.executable, str(chapter_path(4).parents[1] / "scripts" /
                              script), *args], env=local_env())
    assert_one_line_error(done, pattern)


COUNTS = [  # (chapters that have the flag, arguments, the error)
    ([5, 6, 7, 9, 15], ["--clients", "-1"], "--clients: expected a number 0 or more, not '-1'"),
    ([5, 6, 7, 9, 15], ["--clients", "two"], "--clients: expected a number 0 or more, not 'two'"),
    ([6, 7, 9, 15], [SHM_DEAD, "--seed", "-1"], "--seed: expected a number 0..18446744073709551615"),
    ([7, 9, 15], [SHM_DEAD, "--iters", "0"], "--iters must be"),
    ([7, 9, 15], [SHM_DEAD, "--iters", "-1"], "--iters must be"),
    ([6, 7, 9, 15], [SHM_DEAD, "--pages", ""], "--pages must name pages"),
    ([6, 7, 9, 15], [SHM_DEAD, "--page-size", "0"], "0 < page size"),
    ([6, 7, 9, 15], [SHM_DEAD, "--buffers", "0"], "at least one buffer"),
    ([6, 7, 9, 15], [SHM_DEAD, "--buffer-size", "0"], "<= buffer size"),
]


@pytest.mark.long
@pytest.mark.parametrize("chapter,args,pattern", [(c, args, pattern) for chapters, args, pattern
                                                  in COUNTS for c in chapters])
def test_counts_out_of_range_are_usage_errors(chapter, args, pattern):
    """A count below its least (a negative --clients once served forever and exited 0):
    one line, exit 2."""
    done, _ = run(chapter, "-p", "shm", *args)
    assert_one_line_error(done, pattern)
    assert done.returncode == 2

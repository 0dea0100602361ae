"""The command line as people use it: flags anywhere, each side's flags refused by the other,
and printed commands that work when pasted into a plain shell."""
import os
import re
import signal
import subprocess
import sys

import pytest

from common import cli
from common.chapter_pair import ROOT, chapter_path, local_env
from tests.support.one_line_errors import SHM_DEAD, assert_one_line_error, run

PAGES = [6, 7, 9, 10, 11, 12, 13, 14, 15]  # the chapters with a client that takes --page-size


@pytest.mark.parametrize("chapter", [4, 5])
def test_flags_after_both_positionals(chapter):
    """`ADDRESS -p shm "msg"`: parsed, so the (too long) message is what is refused."""
    assert_one_line_error(run(chapter, SHM_DEAD, "-p", "shm", "x" * 5000)[0], "buffer holds")


@pytest.mark.long
@pytest.mark.parametrize("chapter", PAGES)
def test_flags_after_the_address(chapter):
    assert_one_line_error(run(chapter, SHM_DEAD, "-p", "shm", "--pages", "99999")[0],
                          "--pages must name pages")


@pytest.mark.long
@pytest.mark.parametrize("chapter", PAGES)
def test_server_refuses_client_flags(chapter):
    done, _ = run(chapter, "-p", "shm", "--page-size", "1M", "--seed", "7")
    assert_one_line_error(done, "--page-size, --seed: flags of the client")
    assert done.returncode == 2


@pytest.mark.parametrize("chapter", [5, 6, 7, 12])
def test_client_refuses_server_flags(chapter):
    assert_one_line_error(run(chapter, SHM_DEAD, "-p", "shm", "--clients", "1")[0],
                          "--clients: a flag of the server")


@pytest.mark.long
def test_help_says_which_side_reads_each_flag():
    done, _ = run(15, "--help")
    help_text = " ".join(done.stdout.split())
    for flag, side in [("--page-size PAGE_SIZE", "client"), ("--iters ITERS", "client"),
                       ("--clients CLIENTS", "server"), ("--batch B", "server"),
                       ("--json [JSON]", "server")]:
        assert f"{flag} {side}:" in help_text
    assert "each side refuses the other's" in help_text


def server_hint(chapter, *args):
    """Start a server from the repository's root, as a reader does; (process, its hint)."""
    proc = subprocess.Popen([sys.executable, str(chapter_path(chapter).relative_to(ROOT)),
                             "-p", "shm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=local_env(), cwd=ROOT)
    for line in proc.stdout:
        if line.startswith("run the client: "):
            return proc, line.split(": ", 1)[1].strip()
    pytest.fail(f"no client command: {stop(proc)}")


def stop(proc):
    """Ctrl-C, as a reader would: the server closes what it opened (nothing left in /dev/shm)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    return proc.communicate(timeout=30)[1]


@pytest.mark.long
def test_printed_client_command_works_in_a_plain_shell():
    """No venv active, no `python` on PATH: the printed command still runs."""
    proc, hint = server_hint(4)
    try:
        assert not hint.startswith("python ")
        plain = dict(local_env(), PATH="/usr/bin:/bin")
        plain.pop("VIRTUAL_ENV", None)
        done = subprocess.run(hint, shell=True, cwd=ROOT, env=plain, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        out, _ = proc.communicate(timeout=30)
        assert "received 5 bytes: hello" in out
    finally:
        stop(proc)


@pytest.mark.parametrize("chapter,flags", [(7, "--delivery-complete --page-size 64K"),
                                           (12, "--groups 2 --nics-per-gpu 2 --page-size 4K")])
def test_server_hint_is_the_run_that_shows_the_lesson(chapter, flags):
    proc, hint = server_hint(chapter)
    stop(proc)
    assert re.search(rf"-p shm [0-9a-f]+ {flags}", hint), hint
    assert os.path.exists(ROOT / hint.split()[0])


@pytest.mark.long
@pytest.mark.parametrize("chapter", range(3, 17))
def test_help_is_help(chapter):
    """--help prints the usage and exits 0 in every chapter (a positional's %(default)s
    once broke it under parse_intermixed_args)."""
    done, _ = run(chapter, "--help")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.startswith("usage:")


def page_args(*flags):
    p = cli.parser("doc")
    cli.add_peer(p)
    cli.add_pages(p, pages="all", buffer_size=4 << 20)
    return p.parse_args(["00", *flags])


def test_page_size_help_says_what_a_page_size_must_be_and_why():
    p = cli.parser("doc")
    cli.add_pages(p, pages="all", buffer_size=4 << 20)
    text = " ".join(p.format_help().split())
    assert re.search(r"one WRITE per page", text), text
    assert re.search(r"multiple of 64", text), text


def test_a_page_size_off_the_cache_line_is_explained(capsys):
    """--page-size 3000 (issue 48): allowed (odd sizes show the checks hold for any size),
    and the client says in one line what it costs on a real NIC."""
    args = page_args("--page-size", "3000", "--pages", "0")
    cli.check_pages(args, lambda per_buffer: [0])
    assert re.fullmatch(r"note: page size 3000 is not a multiple of 64 .*\n", capsys.readouterr().out)
    args = page_args("--page-size", "4K", "--pages", "0")
    cli.check_pages(args, lambda per_buffer: [0])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "x"])
def test_timeout_is_a_finite_number_of_seconds_at_least_0(value):
    """--timeout nan never ended a wait (every comparison with nan is false); -1 was 0."""
    with pytest.raises(cli.UsageError, match=r"--timeout.*0 or more"):
        cli.parser("doc").parse_args(["--timeout", value])


def test_timeout_0_says_what_it_means():
    text = " ".join(cli.parser("doc").format_help().split())
    assert "0: the peer must answer at once" in text, text

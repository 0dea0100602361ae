"""Every process ends within its bound (common/bounds.py): after SIGINT or SIGTERM of
either side mid-transfer, after its peer was killed, and when a provider call never
returns (faked by tests/programs/stuck.py). Real chapter 07 processes on shm and tcp."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import bounds, cli, shm_files
from common.chaos.faults import python_dropped
from common.chapter_pair import ADDRESS, chapter_path, local_env
from tests.support import shm_regions
from tests.support.budget import Budget
from tests.support.one_line_errors import SHM_DEAD

# Seconds a process may be seen ending after its bound on this 2-core machine with
# other suites beside it (load 8): each of the signal, the watchdog's wake-up and this
# test's wait may find both cores taken. Measured there: at most 0.3 s past a bound.
STOP_MARGIN = 1.0
PEER_MARGIN = 3.0  # the same for a dead peer, whose survivor also closes what it opened
SMALL = ["--buffer-size", "4M", "--pages", "0-63", "--iters", "100000000"]
STUCK = str(Path(__file__).parent / "programs" / "stuck.py")


def own_timeout():
    """The environment of a chapter whose --timeout and SLACK are its own, not the suite's
    stretched ones (tests/conftest.py): the bounds promised are the chapter's."""
    env = local_env()
    env.pop(cli.STRETCH, None)
    return env


def start(args, until):
    """Chapter 07 with `args`, once it has printed a line starting with `until`."""
    proc = subprocess.Popen([sys.executable, str(chapter_path(7)), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=own_timeout())
    out, deadline = "", time.monotonic() + 30
    while until not in out and time.monotonic() < deadline and proc.poll() is None:
        out += proc.stdout.readline()
    assert until in out, out + proc.stderr.read()
    return proc, out


def pair(provider, server_args=()):
    """A server and a client of chapter 07, WRITEs streaming from one into the other."""
    server, out = start(["-p", provider, *server_args], "server address:")
    client, _ = start(["-p", provider, ADDRESS.search(out)[1], *SMALL], "memory:")
    time.sleep(2)  # the CONNECT is in and the WRITEs stream
    return server, client


def ended(proc, within):
    """(exit code, stderr, seconds) of `proc`, which must end within `within` s from now."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within + 30)  # late is a failure, not a hang
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {within + 30:g} s later (bound {within:g} s)")
    return proc.returncode, err, time.monotonic() - start


def stop(*procs):
    """End what a test started, ours or not yet ended: Ctrl-C, else kill (and its regions)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                shm_files.remove_left_by([proc.pid])


def one_line(err, text):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and text in lines[0] and "Traceback" not in err, err


@pytest.mark.parametrize("side", ["server", pytest.param("client", marks=pytest.mark.long)])
@pytest.mark.parametrize("signum", [
    signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.long)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_either_side_mid_transfer_at_once(provider, side, signum):
    server, client = pair(provider)
    try:
        proc = server if side == "server" else client
        proc.send_signal(signum)
        code, err, took = ended(proc, bounds.STOP_BOUND)
        assert code == 128 + signum, err
        one_line(err, "interrupted")
        assert took < bounds.STOP_BOUND + STOP_MARGIN, f"{took:.2f} s: {err}"
        assert not shm_regions.files(proc.pid)
    finally:
        stop(client, server)


@pytest.mark.long
def test_a_client_outlives_its_killed_server(provider):
    """kill -9 of the server mid-transfer: the client ends within --timeout + 5 s, also
    when the dead server held shm's lock on a region (its fi_cq_read then never returns)."""
    server, client = pair(provider)
    try:
        server.kill()
        server.wait()
        code, err, took = ended(client, cli.PEER_TIMEOUT + 5)
        assert code == 1, err
        one_line(err, "error: no heartbeat from the server within")
        assert took < cli.PEER_TIMEOUT + 5 + PEER_MARGIN, f"{took:.2f} s: {err}"
        assert not shm_regions.files(client.pid)
        assert not shm_regions.files(server.pid), "the client left its dead server's regions"
    finally:
        stop(client, server)
        shm_files.remove_left_by([server.pid])


@pytest.mark.long
def test_a_server_removes_its_killed_clients_regions(provider):
    """kill -9 of the client mid-transfer: the server says so and, with --clients 1, ends,
    having removed what the client could not (on 1.17's shm the server may spin on the
    dead client's lock: then its watchdog ends it, and removes them on the way out)."""
    server, client = pair(provider, ["--clients", "1"])
    try:
        client.kill()
        client.wait()
        code, err, took = ended(server, cli.PEER_TIMEOUT + 5)
        assert code in (0, bounds.EXIT_STUCK), err
        assert not shm_regions.files(server.pid)
        assert not shm_regions.files(client.pid), "the server left its dead client's regions"
    finally:
        stop(client, server)
        shm_files.remove_left_by([client.pid])


@pytest.mark.long
def test_a_dead_shm_address_is_given_up_at_the_chapters_own_timeout():
    """Not at a timeout stretched by this machine's load: --timeout means what it says."""
    client = subprocess.Popen([sys.executable, str(chapter_path(7)), "-p", "shm", SHM_DEAD,
                               *SMALL], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=own_timeout())
    try:
        code, err, took = ended(client, cli.PEER_TIMEOUT + 5)
        assert code == 1
        one_line(err, f"within {cli.PEER_TIMEOUT:g} s")
        assert took < cli.PEER_TIMEOUT + 5 + PEER_MARGIN, f"{took:.2f} s: {err}"
    finally:
        stop(client)


def stuck(*args):
    proc = subprocess.Popen([sys.executable, STUCK, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=own_timeout())
    assert proc.stdout.readline() == "waiting\n", proc.stderr.read()
    time.sleep(0.2)  # from its print into the call that hangs
    return proc


@pytest.mark.long
def test_a_wait_whose_provider_call_never_returns_ends_past_its_deadline():
    proc = stuck("wait", "1")
    try:
        code, err, took = ended(proc, 1 + bounds.SLACK)
        assert code == bounds.EXIT_STUCK
        one_line(err, "no heartbeat from the server within 1 s, and the provider call did "
                      "not return")
        assert took < 1 + bounds.SLACK + STOP_MARGIN
    finally:
        stop(proc)


@pytest.mark.long
def test_a_process_stopped_past_its_deadline_gets_its_slack_once_continued():
    """Ctrl-Z then fg: the watchdog does not take the pause for a stuck call; the call still
    stuck SLACK after the continue is."""
    proc = stuck("wait", "1")
    try:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(1 + bounds.SLACK + 1)
        proc.send_signal(signal.SIGCONT)
        time.sleep(bounds.SLACK / 2)
        assert proc.poll() is None, "ended by the watchdog on waking"
        code, err, took = ended(proc, bounds.SLACK / 2 + STOP_MARGIN)
        assert code == bounds.EXIT_STUCK
        one_line(err, "no heartbeat from the server within 1 s, and the provider call did "
                      "not return")
    finally:
        stop(proc)


@pytest.mark.long
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_ends_a_process_stuck_in_a_provider_call(signum):
    proc = stuck("idle")
    try:
        proc.send_signal(signum)
        code, err, took = ended(proc, bounds.STOP_BOUND)
        assert code == 128 + signum
        one_line(err, f"interrupted ({signal.Signals(signum).name}), but a call did not return")
        assert took < bounds.STOP_BOUND + STOP_MARGIN
    finally:
        stop(proc)


@pytest.mark.long
def test_a_stuck_process_ends_when_no_one_reads_its_stderr():
    """A launcher killed with -9 takes its ranks' stderr with it: the watchdog's last line
    cannot be written then (BrokenPipeError), and must not keep it from ending the process."""
    proc = stuck("idle")
    try:
        proc.stderr.close()
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        try:
            code = proc.wait(bounds.STOP_BOUND + 30)
        except subprocess.TimeoutExpired:
            pytest.fail("still running 30 s past its bound")
        assert code == 128 + signal.SIGTERM
        assert time.monotonic() - start < bounds.STOP_BOUND + STOP_MARGIN
    finally:
        stop(proc)


@pytest.mark.long
def test_closing_that_never_returns_ends_the_process():
    """Chapter 15's client hung so in fi_close after its server was killed."""
    proc = stuck("close")
    try:
        bound = bounds.CLOSE_BOUND + bounds.SLACK
        code, err, took = ended(proc, bound)
        assert code == bounds.EXIT_STUCK
        one_line(err, "closing the fabric's objects took more than")
        assert took < bound + STOP_MARGIN
    finally:
        stop(proc)


@pytest.mark.long
def test_a_worker_thread_that_does_not_stop_ends_the_process():
    """The transfer engine's worker stuck in the provider: its join is bounded, and the
    process's shm regions are removed on the way out."""
    proc = stuck("join")
    try:
        code, err, took = ended(proc, bounds.JOIN_BOUND)
        assert code == bounds.EXIT_STUCK
        one_line(err, "the transfer engine: the worker thread did not stop within")
        assert took < bounds.JOIN_BOUND + STOP_MARGIN
        assert not shm_regions.files(proc.pid)
    finally:
        stop(proc)


def test_only_this_processs_shm_regions_are_removed():
    mine, other = (Path(f"/dev/shm/{os.getpid()}{tail}:0:99") for tail in ("", "1"))
    for path in (mine, other):
        path.touch()
    try:
        shm_files.remove_left_by([os.getpid()])
        assert not mine.exists() and other.exists()
    finally:
        for path in (mine, other):
            path.unlink(missing_ok=True)


@pytest.mark.long
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_chapter_starts_is_its_exit_and_one_line(sig):
    """At any moment of a chapter's start: Python importing numpy and the binding, libfabric
    loading its providers (Debian's PSM then installs handlers that exit(1)), main() opening
    the fabric. A signal there once gave exit 1 with nothing said, or a traceback and 130 for
    SIGTERM. Until the chapter's first import of the project installs ours, the handlers are
    Python's (its start, the standard library's imports: milliseconds): the process dies
    by the signal, or, inside Python's own start, with its fatal error, or CPython prints
    and drops it (common/chaos/faults.python_dropped)."""
    wrong = []
    for delay in [0.05 * k for k in range(1, 21)]:
        proc = subprocess.Popen([sys.executable, str(chapter_path(6)), "-p", "shm", SHM_DEAD,
                                 "--timeout", "5"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env=own_timeout())
        time.sleep(delay)
        proc.send_signal(sig)
        rc, err, _ = ended(proc, bounds.STOP_BOUND + STOP_MARGIN)
        lines = err.strip().splitlines()
        if rc == -sig or (rc == 1 and "Fatal Python error" in err) or python_dropped(err):
            continue  # Python's own handlers: before common/bounds.quiet_start put ours
        if rc != 128 + sig or len(lines) != 1 or "Traceback" in err:
            wrong.append((delay, rc, err))
    assert not wrong, wrong


def program(folder, name, source, stdout=subprocess.DEVNULL):
    """Start the Python program `source`, written to folder/name; its stderr piped."""
    path = folder / name
    path.write_text(source)
    return subprocess.Popen([sys.executable, str(path)], stdout=stdout, stderr=subprocess.PIPE,
                            text=True, env=own_timeout())


def test_a_signal_whose_clean_up_then_failed_is_still_the_signal(tmp_path):
    """A SIGTERM cut into argparse's parse_intermixed_args, whose `finally` then read an
    attribute its `try` had not set yet: an AttributeError's traceback, exit 1, not 143."""
    proc = program(tmp_path, "cut.py", "import os, signal\n"
                                       "from common import cli\n\n\n"
                                       "def main():\n"
                                       "    try:\n"
                                       "        os.kill(os.getpid(), signal.SIGTERM)\n"
                                       "    finally:\n"
                                       "        object().save_nargs\n\n\n"
                                       "cli.run(main)\n")
    try:
        code, err, _ = ended(proc, bounds.STOP_BOUND + STOP_MARGIN)
        assert code == 128 + signal.SIGTERM, err
        one_line(err, "cut.py: interrupted, resources closed")
    finally:
        stop(proc)


@pytest.mark.long
def test_a_signal_after_main_returned_changes_nothing(tmp_path):
    """A launcher stopping ranks that have just finished: a SIGTERM while Python finalized
    (held open here by a thread that main() left running) printed a traceback from
    threading's shutdown, or, later, killed the process (-15) after its work was done."""
    # 'done' once main() has returned, from inside the exit (cli.run's last flush of
    # stdout, held a second there): a SIGTERM sent when main() printed it itself could
    # still come before main() returned, which must end it with 143. main() also leaves a
    # thread running, which held Python's finalization open.
    proc = program(tmp_path, "finished.py", "import os, sys, threading, time\n"
                                            "from common import cli\n\n\n"
                                            "class Held:\n"
                                            "    def __init__(self, out):\n"
                                            "        self.out, self.armed = out, False\n\n"
                                            "    def write(self, text):\n"
                                            "        return self.out.write(text)\n\n"
                                            "    def flush(self):\n"
                                            "        self.out.flush()\n"
                                            "        if self.armed:\n"
                                            "            self.armed = False\n"
                                            "            os.write(1, b'done\\n')\n"
                                            "            time.sleep(1)\n\n\n"
                                            "sys.stdout = Held(sys.stdout)\n\n\n"
                                            "def main():\n"
                                            "    threading.Thread(target=time.sleep,"
                                            " args=(5,)).start()\n"
                                            "    sys.stdout.armed = True\n\n\n"
                                            "cli.run(main)\n", stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "done\n", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        code, err, took = ended(proc, bounds.STOP_BOUND)
        assert (code, err) == (0, "") and took < bounds.STOP_BOUND + STOP_MARGIN
    finally:
        stop(proc)


@pytest.mark.parametrize("loaded", ["before the binding", "the binding's"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_a_child_not_yet_execd_is_its_parents_to_act_on(loaded, sig):
    """A terminal's Ctrl-C can reach a child between fork and exec, still in our process
    group, where our handlers run in the parent's copied code (Python's at-fork hooks, a
    preexec_fn): it raised there ("Exception ignored in: Random.seed", a traceback) and was
    lost. The parent, which got it too, stops the child it starts (common/chapter_pair)."""
    code = ("import os, signal, sys, time\n"
            f"import {'common' if loaded.startswith('before') else 'common.fabric'}\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            f"    os.kill(os.getpid(), {int(sig)})\n"
            "    for _ in range(100): time.sleep(0.001)  # the handler runs between these\n"
            "    os._exit(7)\n"
            "sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n")
    done = Budget(60).run([sys.executable, "-c", code], env=local_env())
    assert done.returncode == 7 and done.stderr == "", done.stderr

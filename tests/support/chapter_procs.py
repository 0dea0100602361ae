"""A chapter's processes started by hand, for tests that act on them while they run
(tests/test_07_queue.py, tests/test_09_15_multinet.py, tests/test_fabric_connect.py,
tests/test_fabric_efa_direct.py): one started until it prints a line; a client faulted
mid-run and the next one served."""
import re
import signal
import subprocess
import sys
import threading
import time

from common import shm_files
from common.cli import PEER_TIMEOUT
from common.chapter_pair import ADDRESS, chapter_path, local_env
from tests.support.budget import Budget

SMALL = ["--buffer-size", "4M", "--pages", "0-63"]  # 64 pages of 64 KiB


def start(chapter, args, until):
    """A chapter's process, once it has printed a line matching `until`."""
    proc = subprocess.Popen([sys.executable, str(chapter_path(chapter)), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=local_env())
    out, budget = "", Budget(20)  # a busy machine's Python takes seconds to import numpy
    while not re.search(until, out, re.MULTILINE) and budget.left() > 0:
        out += proc.stdout.readline()
    assert re.search(until, out, re.MULTILINE), out
    return proc, out


def fault_then_next_client(chapter, provider, fault, next_waits, server_args=(),
                           client_args=()):
    """A server for two clients; the first gets `fault` while WRITEs stream into it, the
    next is started at once and waits `next_waits` times a peer's wait, and must verify
    every page; the server ends well, without a traceback. Returns (the server's stderr,
    its wait for a peer, as given)."""
    budget = Budget(120)
    wait, next_wait = (f"{budget.grant(s):g}"
                       for s in (PEER_TIMEOUT, next_waits * PEER_TIMEOUT))
    server, out = start(chapter, ["-p", provider, "--clients", "2", "--timeout", wait,
                                  *server_args], ADDRESS.pattern)
    procs = [server]
    try:
        address = ADDRESS.search(out)[1]
        first, _ = start(chapter, ["-p", provider, address, "--iters", "100000000", *SMALL,
                                   *client_args], "^memory:")
        procs.append(first)
        time.sleep(1)
        first.send_signal(fault)
        if fault == signal.SIGINT:
            assert first.wait(budget.grant(10)) == 130
        done = budget.run([sys.executable, str(chapter_path(chapter)), "-p", provider,
                           address, "--iters", "500", "--timeout", next_wait, *SMALL,
                           *client_args],
                          env=local_env())
        if done.returncode != 0:  # the server still waits for a client: it ends on Ctrl-C
            server.send_signal(signal.SIGINT)
        _, err = budget.communicate(server)
        assert done.returncode == 0, f"the next client: {done.stderr}the server: {err}"
        assert re.search(r"verified .*64 pages .*: 0 wrong bytes", done.stdout)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        shm_files.remove_left_by([proc.pid for proc in procs])  # killed with -9: nothing removed
    assert server.returncode == 0, err
    assert "Traceback" not in err
    return err, wait


def client_gone_server_survives(chapter, provider, server_args=(), client_args=()):
    """A client stopped while WRITEs stream into it (Ctrl-C: it closes what it opened):
    the server says so in one line, and serves the next one. Where the provider
    reports the failed WRITE (shm in 1.17 and 2.6: EIO; tcp: the closed connection),
    the line says "gone"; 2.1's shm reports nothing, and its WRITEs stop completing.

    The server's wait is a chapter's own for a peer, stretched by the load: it is also
    its wait for the next client, which a starved CPU can hold up for seconds (a 2 s
    wait took a live client paused 3 s for a gone one, and stopped its heartbeats). The
    next client waits twice that: the server first drains the gone one's WRITEs."""
    err, wait = fault_then_next_client(chapter, provider, signal.SIGINT, 2, server_args,
                                       client_args)
    # gone before its run began (a busy machine's server still warming up): that WRITE's wait
    assert re.search(rf"^client 1: (gone: fi_cq_read: |failed: no WRITE completed for {wait} s |"
                     rf"failed: warmup WRITE on NIC \d+ not completed in {wait} s$)",
                     err, re.MULTILINE), err


def server_line(server, budget):
    """The server's next line on stderr, within the budget (its reader blocks: a thread)."""
    got = []
    reader = threading.Thread(target=lambda: got.append(server.stderr.readline()), daemon=True)
    reader.start()
    reader.join(budget.left())
    if got and got[0]:
        return got[0]
    code = server.poll()
    assert code is not None, f"the server said nothing in the test's {budget.seconds:g} s"
    raise AssertionError(f"the server ended (exit {code}) without a line")

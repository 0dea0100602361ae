"""CONNECT (common/fabric/connect.py): it fits one SEND of the NIC, it says whose client sent it,
and a server refuses another chapter's client by name, then serves the next; an idle
server leaves the CPU to others."""
import argparse
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import cli
from common.engine import multinet
from common.fabric import connect
import common.fabric as fi
from common.chapter_pair import ADDRESS, chapter_module, chapter_path, local_env, run_pair
from tests.support.chapter_procs import start

EFA_ADDRESS = bytes(32)  # an efa endpoint name: struct efa_ep_addr (prov/efa/src/efa_base_ep.h)
SMALL_LIMIT = 8928       # bytes: an EFA link's MTU, less than the old CONNECTs
GIB_PAGES = 1 << 14      # 64 KiB pages in a 1 GiB buffer


def series_pages(buffers):
    """The default pages of 07 and 09-15: the first 1000 of each 1 GiB buffer."""
    return [b * GIB_PAGES + i for b in range(buffers) for i in range(1000)]


@pytest.fixture
def small_mtu(monkeypatch):
    """Every NIC carries at most SMALL_LIMIT bytes in one SEND."""
    monkeypatch.setattr(connect.fi, "max_send", lambda info: SMALL_LIMIT)


def test_07_with_3_buffers_fits_where_its_old_connect_did_not(small_mtu):
    args = argparse.Namespace(seed=42, page_size=64 << 10, iters=1_000_000,
                              delivery_complete=False, pages=series_pages(3))
    new = chapter_module(7).request(args, EFA_ADDRESS, [(0, 1 << 30, 0)] * 3)
    # the old format: header, address, a region per buffer, 4 bytes per page
    old = struct.calcsize("<QQQIHH") + len(EFA_ADDRESS) + 3 * 24 + 3000 * 4
    assert old == 12136
    with pytest.raises(cli.UsageError, match="CONNECT would be 12136 bytes"):
        connect.fits(None, old, "pages or buffers")
    connect.fits(None, len(new), "pages or buffers")
    assert len(new) < 1000


def test_09_on_8_gpus_x_4_nics_fits_where_its_old_connect_did_not(small_mtu):
    lanes = 8 * 4
    args = argparse.Namespace(number=9, seed=42, page_size=64 << 10, iters=1_000_000,
                              pages=series_pages(2), buffers=2, groups=8)
    new = multinet.request(args, EFA_ADDRESS, [EFA_ADDRESS] * lanes,
                           bytes(multinet.REGION.size * lanes * 2))
    # the old format: header, 33 addresses with their lengths, 64 regions, 4 bytes per page
    old = struct.calcsize("<QQQIHHH") + 33 * (2 + 32) + lanes * 2 * 24 + 2000 * 4
    assert old == 10692
    with pytest.raises(cli.UsageError):
        connect.fits(None, old, "pages, buffers or NICs")
    connect.fits(None, len(new), "pages, buffers or NICs")
    assert len(new) < 3000


@pytest.mark.long
@pytest.mark.parametrize("chapter,args,verified", [
    (7, ["--buffers", "3", "--iters", "3000"], "verified 3000 pages (12288000 bytes)"),
    (9, ["--groups", "8", "--nics-per-gpu", "4", "--iters", "16000"],
     "verified 8 x 2000 pages (65536000 bytes)"),
])
def test_the_series_layouts_run_within_the_fallback_mtu(chapter, args, verified):
    """The default pages (1000 per buffer; of 4 KiB here, to keep it small) of 07 with 3
    buffers and of 09 on 8 x 4 virtual NICs: 12 and 10 KB in the old format, more than
    the 4096 bytes that a server's inbox holds on shm."""
    pair = run_pair(chapter, "shm", ["--clients", "1", "--timeout", "60"],
                    [["--buffer-size", "4M", "--page-size", "4K", "--timeout", "60", *args]])
    assert pair.ok, pair
    assert f"{verified}: 0 wrong bytes" in pair.clients[0].out


def test_connect_says_whose_it_is():
    message = connect.pack(9, b"where", b"rest")
    assert message.startswith(connect.MAGIC) and connect.is_connect(message)
    assert connect.unpack(message, 9) == (b"where", b"rest", None)
    assert connect.unpack(message, 7)[2] == ("this is chapter 07's server; "
                                             "you ran chapter 09's client")
    assert not connect.is_connect(b"Thello")


@pytest.mark.parametrize("pages", [[0, 1, 2, 7, 8, 3], [5], list(range(3000))])
def test_page_runs_keep_pages_and_order(pages):
    runs, packed = connect.pack_pages(pages)
    assert connect.unpack_pages(packed, 0, runs, 4096) == pages


def test_messages_are_taken_in_the_order_they_came():
    """05's server has two receives posted; a client's text must not overtake its CONNECT
    when the text landed in the buffer listed first."""
    poller = fi.Poller(None)
    first, second = (fi.ffi.new("struct fi_context2 *") for _ in range(2))
    poller.done[fi.key(second)] = 7  # completed first
    poller.done[fi.key(first)] = 9
    assert poller.wait([first, second], 1, "message") == (second, 7)


@pytest.mark.parametrize("error,gone", [
    (fi.CompletionError(5, "Input/output error", None), True),  # shm 1.17: a dead peer
    (fi.CompletionError(-125, "Operation canceled", None), True),  # tcp: connection closed
    (fi.CompletionError(-107, "Transport endpoint is not connected", None), True),  # efa
    (fi.CompletionError(-22, "Invalid argument", None), False),
    (TimeoutError("no WRITE completed for 2 s"), False),
])
def test_a_peer_gone_is_told_from_other_failures(error, gone, capsys):
    connect.report(3, error)
    assert capsys.readouterr().err == f"client 3: {'gone' if gone else 'failed'}: {error}\n"


def test_send_limit_is_the_links_mtu_or_a_stated_fallback():
    assert fi.send_limit(8760, 2 ** 64 - 1) == 8760      # efa: the device's max_msg_sz
    assert fi.send_limit(4096, 1 << 31) == 4096          # verbs: the port's active MTU
    assert fi.send_limit(0, 2 ** 64 - 1) == fi.FALLBACK_MTU  # shm, tcp: no NIC
    assert fi.send_limit(8760, 2048) == 2048             # never above max_msg_size
    for provider in ("shm", "tcp"):
        info, _ = fi.pick(provider, multinet.CAPS)
        assert fi.max_send(info) == fi.FALLBACK_MTU  # they name no NIC, hence no MTU


@pytest.mark.long
def test_pages_that_do_not_fit_one_send_are_refused_at_start():
    scattered = ",".join(str(p) for p in range(0, 1200, 2))  # 600 runs of one page
    done = subprocess.run([sys.executable, str(chapter_path(7)), "-p", "shm",
                           b"fi_shm://999999999:0:0\0".hex(), "--page-size", "4K",
                           "--buffer-size", "4M", "--pages", scattered],
                          capture_output=True, text=True, env=local_env(), timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"07_queue.py: error: too many pages or buffers: CONNECT would be "
        f"{connect.PREAMBLE.size + 64 + 31 + 2 * 24 + 600 * 8} bytes, and one SEND on this "
        f"NIC carries at most {fi.FALLBACK_MTU} (fabric.max_send)"]


CLIENT_ARGS = {5: ["hello"], 6: ["--pages", "0-3"],
               7: ["--iters", "500", "--buffer-size", "4M", "--pages", "0-63"],
               **{n: ["--iters", "500", "--buffer-size", "4M", "--pages", "0-63",
                      "--nics-per-gpu", "2"] for n in range(9, 16)}}
VERIFIED = {5: "got back 'olleh'", 6: "verified 4 pages", 7: "verified 64 pages",
            **{n: "verified 1 x 64 pages" for n in range(9, 16)}}
NEIGHBOURS = [(5, 6), (6, 7), (7, 9), *((n, n + 1) for n in range(9, 15))]  # 08 has no server


def run_client(chapter, provider, address):
    return subprocess.run([sys.executable, str(chapter_path(chapter)), "-p", provider,
                           "--timeout", "30", address, *CLIENT_ARGS[chapter]],
                          capture_output=True, text=True, env=local_env(), timeout=120)


@pytest.mark.long
@pytest.mark.parametrize("server,client", [(9, 7), (7, 9), (5, 7), (6, 5), (9, 6)])
def test_a_client_of_another_chapter_is_refused_by_name(server, client, provider):
    """Both sides say which chapters met; the server goes on to serve its own client (the
    one of --clients 1: a client it refused is not one it served)."""
    refused_then_served(server, client, provider)


@pytest.mark.long
@pytest.mark.parametrize("server,client", [*NEIGHBOURS, *((b, a) for a, b in NEIGHBOURS)])
def test_neighbours_refuse_each_others_clients(server, client):
    refused_then_served(server, client, "shm")


def refused_then_served(server, client, provider):
    proc, out = start(server, ["-p", provider, "--clients", "1", "--timeout", "30"],
                      ADDRESS.pattern)
    try:
        address = ADDRESS.search(out)[1]
        why = f"this is chapter {server:02d}'s server; you ran chapter {client:02d}'s client"
        wrong = run_client(client, provider, address)
        assert wrong.returncode == 1, wrong
        assert wrong.stderr.strip().splitlines()[-1] == (
            f"{chapter_path(client).name}: error: the server refused: {why}")
        right = run_client(server, provider, address)
        assert right.returncode == 0, right.stderr
        assert VERIFIED[server] in right.stdout
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert f"client 1: refused: {why}" in err.splitlines()


@pytest.mark.long
@pytest.mark.parametrize("client", [5, 7])
def test_04_says_a_connect_is_not_its_text(client):
    """04's server takes one text; a later chapter's CONNECT is said to be one, in one line
    (04 cannot answer: it never learns its client's address), and its client gives up."""
    proc, out = start(4, ["-p", "shm"], ADDRESS.pattern)
    try:
        wrong = subprocess.run([sys.executable, str(chapter_path(client)), "-p", "shm",
                                "--timeout", "3", ADDRESS.search(out)[1], *CLIENT_ARGS[client]],
                               capture_output=True, text=True, env=local_env(), timeout=120)
        rest, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "received" not in rest, rest
    assert err.splitlines() == [
        f"04_hello.py: error: received a CONNECT from chapter {client:02d}'s client, not a "
        f"text: run chapter {client:02d}'s server for that client"]
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr, wrong.stderr


@pytest.mark.long
def test_a_message_that_is_no_connect_is_ignored_not_served():
    """A chapter 04 client's text where a CONNECT was due: one line, and not a client."""
    proc, out = start(7, ["-p", "shm", "--clients", "1", "--timeout", "30"], ADDRESS.pattern)
    try:
        address = ADDRESS.search(out)[1]
        stray = subprocess.run([sys.executable, str(chapter_path(4)), "-p", "shm", address,
                                "hello"], capture_output=True, text=True, env=local_env(),
                               timeout=60)
        assert stray.returncode == 0, stray.stderr  # 04 only sends
        right = run_client(7, "shm", address)
        assert right.returncode == 0, right.stderr
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert err.splitlines() == ["ignored a 5-byte message that is not a CONNECT"]


def sleeps(pid, seconds=2.0):
    """How many times process `pid`'s main thread went to sleep of its own accord within
    `seconds` (voluntary context switches: a nap, a blocking call). A poller that spins,
    sched_yield included, stays runnable and makes none, however busy the machine; a
    sleeper makes one a nap. (How often it is found runnable says nothing on a busy
    machine: a sleeper that wakes waits for a core in state R, 54-61% of the samples at
    a load of 15 on 2 cores.)"""
    def count():
        status = Path(f"/proc/{pid}/status").read_text()
        return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", status, re.M)[1])
    before = count()
    time.sleep(seconds)
    return count() - before


@pytest.mark.long
@pytest.mark.parametrize("chapter", [5, 6, 7, 9])
def test_an_idle_server_leaves_the_cpu_alone(chapter):
    """While no client is connected, a server sleeps between its CQ reads (naps of at most
    fi.IDLE_NAP[1], 4 ms: hundreds in 2 s on a quiet machine, tens on a busy one)."""
    proc, _ = start(chapter, ["-p", "shm"], ADDRESS.pattern)
    try:
        time.sleep(1)  # past starting up
        naps = sleeps(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)  # it closes what it opened: nothing left in /dev/shm
        proc.wait(30)
    assert naps >= 20, f"{naps} sleeps in 2 s: it polls without sleeping"

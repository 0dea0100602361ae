"""Chapters 09-15: G groups x N (virtual) NICs, one immediate per NIC, every page checked."""
import argparse
import re
import threading

import pytest

from common.engine import multinet, topo
from common.engine.nics import first_of_each, split_among
from common.engine.opqueue import Connection
from common.fabric import connect
import common.fabric as fi
from common.chapter_pair import run_pair
from tests.support.chapter_procs import client_gone_server_survives
from tests.support.gpu import has_gpu, needs_gpus
from tests.support.one_line_errors import SHM_DEAD, assert_one_line_error, run

SMALL = ["--buffer-size", "4M", "--pages", "0-63", "--iters", "3001"]


ENGINES = [(9, []), (10, []), (11, ["--engine", "native"]), (11, ["--engine", "python"]),
           (12, []), (13, []), (14, []), (15, [])]
IDS = ["09", "10", "11c", "11py", "12", "13", "14", "15"]


@pytest.mark.parametrize("chapter,server_args", ENGINES, ids=IDS)
@pytest.mark.parametrize("groups,nics", [  # the fast tier: 2 groups of 2 NICs
    pytest.param(1, 1, marks=pytest.mark.long), pytest.param(1, 4, marks=pytest.mark.long), (2, 2)])
def test_every_nic_delivers(chapter, server_args, groups, nics, provider):
    pair = run_pair(chapter, provider, ["--clients", "1", *server_args],
                    [["--groups", str(groups), "--nics-per-gpu", str(nics), *SMALL]])
    assert pair.ok and not pair.stopped, pair
    client, server = pair.clients[0].out, pair.server.out
    lanes = groups * nics
    assert f"{groups} x {nics} virtual NICs: independent domains of {provider}" in client
    immediates = re.search(r"immediate data from (\d+) NICs, one each: ([\d ]+)$", client,
                           re.MULTILINE)
    assert immediates and int(immediates[1]) == lanes
    counts = [int(x) for x in immediates[2].split()]
    assert len(counts) == lanes and sum(counts) == 3001 and max(counts) - min(counts) <= 1
    assert f"verified {groups} x 64 pages ({groups * 64 * 65536} bytes): 0 wrong bytes" in client
    assert f"WRITEs per NIC: {' '.join(map(str, counts))}" in server
    if chapter == 11:
        assert f"{groups} {server_args[1]} worker threads, one per GPU" in server
    if chapter >= 12:
        assert re.search(rf"{groups} native worker threads, one per GPU, pinned to cores \d+", server)
    if chapter >= 10:
        assert re.search(rf"warmup: first WRITE per NIC [\d.]+ ms on average, [\d.]+ ms at most "
                         rf"\({lanes} NICs\)", server)
        assert "first contact vs a warm WRITE:" in server


@pytest.mark.long
@pytest.mark.parametrize("chapter", [9, 13])
def test_a_dozen_nics(chapter, provider):
    """Twelve lanes and the control endpoint: shm names the last ones "...:10:0" and up,
    longer than the first; each address travels with its own length."""
    pair = run_pair(chapter, provider, ["--clients", "1"],
                    [["--groups", "3", "--nics-per-gpu", "4", *SMALL]])
    assert pair.ok and not pair.stopped, pair
    assert f"verified 3 x 64 pages ({3 * 64 * 65536} bytes): 0 wrong bytes" in pair.clients[0].out


def nics(count):
    return [topo.Nic(f"nic{i}", f"0000:{i + 16:02x}:00.0", 100) for i in range(count)]


def test_real_nics_are_shared_out_evenly():
    assert [len(g) for g in first_of_each([nics(4), nics(4)], None)] == [4, 4]
    assert [len(g) for g in first_of_each([nics(4), nics(4)], 2)] == [2, 2]
    assert [len(g) for g in split_among(nics(8), 2)] == [4, 4]
    with pytest.raises(ValueError, match="do not split evenly into 3"):
        first_of_each([nics(4)], 3)
    with pytest.raises(ValueError, match="a GPU here has only 4"):
        first_of_each([nics(4)], 8)
    with pytest.raises(ValueError, match="do not split evenly among 3 groups"):
        split_among(nics(4), 3)


@pytest.mark.long
@pytest.mark.parametrize("chapter", [9, 10, 11, 12, 13, 14, 15])
@pytest.mark.parametrize("args,pattern", [
    (["--nics-per-gpu", "0"], "must be 1..64"),
    (["--groups", "0"], "must be 1..64"),
    (["--groups", "2", "--nics-per-gpu", "4", "--iters", "7"], "at least one WRITE per NIC"),
    (["--gpus", "x"], "GPU numbers"),
    (["--gpus", "0,99"] if has_gpu() else ["--gpus", "0"], "GPU"),
    (["--page-size", "0"], "0 < page size"),
])
def test_bad_input(chapter, args, pattern):
    done, _ = run(chapter, "-p", "shm", SHM_DEAD, *args)
    assert_one_line_error(done, pattern)


@pytest.mark.long
@pytest.mark.parametrize("chapter,server_args", [(11, ["--engine", "native"]),
                                                 (11, ["--engine", "python"]), (14, []),
                                                 (15, [])], ids=["11c", "11py", "14", "15"])
def test_refusals_wait_in_order_and_nothing_is_lost(chapter, server_args):
    # shm without CMA runs out of bounce buffers at once: -FI_EAGAIN on every NIC
    pair = run_pair(chapter, "shm", ["--clients", "1", *server_args],
                    [["--groups", "2", "--nics-per-gpu", "2", *SMALL]],
                    env={"FI_SHM_DISABLE_CMA": "1", "FI_SHM_RX_SIZE": "8", "FI_SHM_TX_SIZE": "8"})
    assert pair.ok, pair
    eagain = re.search(r"-FI_EAGAIN (\d+) times", pair.server.out)
    assert eagain and int(eagain[1]) > 0
    assert "verified 2 x 64 pages (8388608 bytes): 0 wrong bytes" in pair.clients[0].out


@pytest.mark.long
@pytest.mark.parametrize("chapter,server_args", ENGINES, ids=IDS)
def test_client_gone_mid_run_server_survives(chapter, server_args):
    client_gone_server_survives(chapter, "shm", server_args,
                                ["--groups", "2", "--nics-per-gpu", "2"])


def test_a_refused_client_hears_why_at_once(provider):
    """A server that will not serve a client says why, and the client stops on that (its
    error says so), not on the heartbeat timeout (a TimeoutError). Only a server with GPUs
    refuses (its GPUs against the client's groups), before it touches them: so both sides
    run here, in threads."""
    info, _ = fi.pick(provider, multinet.CAPS)
    why = "the client has 1 groups, this server 2 GPUs"
    with fi.Closer() as own:
        server, client, lane = (multinet.Lane(own, info) for _ in range(3))
        server_inbox = fi.Inbox(own, server.domain, server.ep, fi.max_send(info))
        client_inbox = fi.Inbox(own, client.domain, client.ep,
                                len(connect.REFUSED) + connect.WHY)
        request = connect.pack(9, fi.getname(client.ep),
                               multinet.HEADER.pack(1, 4096, 1, 1, 1, 1, 1)
                               + multinet.pack_names([fi.getname(lane.ep)]))
        failed = []

        def serve():  # as multinet.server serves each CONNECT
            try:
                addr, body = connect.accept(own, info, server.av, server.domain, server.ep,
                                            server.poller, request, 9, 20.0)
                conn = Connection(own, server.domain, addr, server.queue, server_inbox, [], 20.0)
                multinet.serve(conn, info, body, argparse.Namespace(gpus=[0, 1]), None)
            except ValueError as e:
                failed.append(str(e))
        thread = threading.Thread(target=serve)
        thread.start()
        with pytest.raises(ValueError, match=f"^the server refused: {why}$"):
            multinet.wait_immediates(client, client_inbox, [lane], argparse.Namespace(
                gpus=None, groups=1, iters=1, page_size=4096, timeout=20.0))
        thread.join(20)
        assert failed == [why]


@pytest.mark.parametrize("chapter", [14, 15])
def test_batch_is_bounded(chapter):
    done, _ = run(chapter, "-p", "shm", SHM_DEAD, "--batch", "0")
    assert_one_line_error(done, "expected a number 1..1024, not '0'")


@needs_gpus(2)
@pytest.mark.parametrize("chapter", [9, 11, 15])
def test_gpu_each_writes_to_the_other(chapter):
    # server's groups on GPUs 0 and 1, client's on 1 and 0: every page crosses between GPUs
    pair = run_pair(chapter, "shm", ["--clients", "1", "--gpus", "0,1"],
                    [["--gpus", "1,0", "--nics-per-gpu", "2", "--page-size", "1M",
                      "--buffer-size", "64M", "--pages", "0-63", "--iters", "2000"]])
    assert pair.ok, pair
    assert "immediate data from 4 NICs, one each: 500 500 500 500" in pair.clients[0].out
    assert "verified 2 x 64 pages (134217728 bytes): 0 wrong bytes" in pair.clients[0].out


@needs_gpus(2)
def test_gpu_server_refuses_a_client_of_other_groups_at_once():
    pair = run_pair(9, "shm", ["--clients", "1", "--gpus", "0,1"], [["--groups", "1"]])
    client = pair.clients[0]
    assert client.rc != 0, pair  # said why, not "no heartbeat from the server"
    assert client.err.strip().endswith(
        "error: the server refused: the client has 1 groups, this server 2 GPUs"), pair
    assert "client 1: failed: the client has 1 groups, this server 2 GPUs" in pair.server.err

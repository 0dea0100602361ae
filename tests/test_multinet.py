"""Chapters 09 and 10: G groups x N (virtual) NICs, one immediate per NIC, every page checked."""
import re

import pytest

from common import topo
from scripts.pair import run_pair
from tests.gpu import has_gpu
from tests.test_bad_input import SHM_DEAD, assert_one_line_error, run

SMALL = ["--buffer-size", "4M", "--pages", "0-63", "--iters", "3001"]


@pytest.mark.parametrize("chapter", [9, 10])
@pytest.mark.parametrize("groups,nics", [(1, 1), (1, 4), (2, 2)])
def test_every_nic_delivers(chapter, groups, nics, provider):
    pair = run_pair(chapter, provider, ["--clients", "1"],
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
    if chapter == 10:
        assert re.search(rf"warmup: first WRITE per NIC [\d.]+ ms on average, [\d.]+ ms at most "
                         rf"\({lanes} NICs\)", server)
        assert "first contact vs steady state:" in server


def nics(count):
    return [topo.Nic(f"nic{i}", f"0000:{i + 16:02x}:00.0", 100) for i in range(count)]


def test_real_nics_are_shared_out_evenly():
    assert [len(g) for g in topo.take([nics(4), nics(4)], None)] == [4, 4]
    assert [len(g) for g in topo.take([nics(4), nics(4)], 2)] == [2, 2]
    assert [len(g) for g in topo.split(nics(8), 2)] == [4, 4]
    with pytest.raises(ValueError, match="do not split evenly into 3"):
        topo.take([nics(4)], 3)
    with pytest.raises(ValueError, match="a GPU here has only 4"):
        topo.take([nics(4)], 8)
    with pytest.raises(ValueError, match="do not split evenly among 3 groups"):
        topo.split(nics(4), 3)


@pytest.mark.parametrize("chapter", [9, 10])
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

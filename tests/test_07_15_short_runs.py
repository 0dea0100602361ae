"""Fewer WRITEs (--iters) than pages: the client checks the pages the WRITEs reach, no others,
and says how many; a wrong byte reported is a real one. Chapters 07 and 09-15."""
import math
import re

import pytest

from common import cli
from common.engine import multinet
from common.chapter_pair import run_pair

PAGES = ["--buffer-size", "4M", "--pages", "0,5,9-15,40-61,100"]  # of 2 x 64 pages of 64 KiB
NPAGES = len(cli.parse_pages(PAGES[-1]))  # 32
ENGINES = [9, 10, 11, 12, 13, 14, 15]  # chapter 09's engine and those built on it
LANES = ["--groups", "2", "--nics-per-gpu", "2"]


def checked(out):
    """(pages checked, wrong bytes) from the client's line."""
    m = re.search(r"^verified (?:(\d+) of )?([\d x]+) pages \(\d+ bytes\).*: (\d+) wrong bytes$",
                  out, re.MULTILINE)
    assert m, out
    total = math.prod(map(int, m[2].split(" x ")))  # "2 x 32" -> 64
    return int(m[1] or total), int(m[3])


def client_checks(chapter, client_args):
    pair = run_pair(chapter, "shm", ["--clients", "1"], [client_args])
    assert pair.ok, pair
    return checked(pair.clients[0].out)


@pytest.mark.long
@pytest.mark.parametrize("iters", [1, 2, 31, 32, 100])
def test_07_checks_what_its_writes_reach(iters):
    assert client_checks(7, ["--iters", str(iters), *PAGES]) == (min(iters, NPAGES), 0)


@pytest.mark.long
@pytest.mark.parametrize("chapter", ENGINES)
@pytest.mark.parametrize("iters", [4, 7, 100])  # 4: one WRITE per lane, the fewest there are
def test_engines_check_what_their_writes_reach(chapter, iters):
    expected = min(iters, 2 * NPAGES)  # the lanes' shares are even and their pages distinct
    assert client_checks(chapter, ["--iters", str(iters), *LANES, *PAGES]) == (expected, 0)


@pytest.mark.parametrize("iters,groups,per_group,pages", [
    (3, 1, 1, list(range(10))), (10, 1, 1, [7, 7, 8]), (5, 2, 2, list(range(64))),
    (4, 1, 4, [3]), (9, 1, 2, [0, 1, 2]), (1000, 2, 3, list(range(40))),
])
def test_written_is_what_the_lanes_post(iters, groups, per_group, pages):
    """multinet.written, against the server's own posting: lane k's WRITE s goes to
    the page of its message s modulo its messages."""
    lanes = groups * per_group
    posted = [set() for _ in range(groups)]
    for k, count in enumerate(multinet.lane_iters(iters, lanes)):
        mine = multinet.lane_pages(k % per_group, per_group, len(pages))
        posted[k // per_group] |= {pages[mine[s % len(mine)]] for s in range(count)}
    assert [sorted(set(w)) for w in multinet.written(pages, iters, groups, per_group)] \
        == [sorted(p) for p in posted]
    assert sum(multinet.lane_iters(iters, lanes)) == iters

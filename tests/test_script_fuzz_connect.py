"""scripts/fuzz_connect.py: its lies (seeded, every kind drawn), the servers' answers to the
kinds that broke them, a short run at one chapter in the fast tier, every chapter on shm
and tcp in the long one; and the checks the lies led to (common/fabric, connect.py)."""
import re
import subprocess
import sys

import pytest

import common.fabric as fi
from common.chapter_pair import ROOT, local_env
from common.fabric import connect, lib
from common.chaos import lies
from scripts import fuzz_connect as fz
from tests.support.budget import Budget

FUZZ = [sys.executable, str(ROOT / "scripts" / "fuzz_connect.py")]
ME = lies.Me(b"fi_shm://4242:0:0\0", "shm",
             [(0x7000_0000, lies.ROOM, 11), (0x7100_0000, lies.ROOM, 12)], 4096)


@pytest.mark.parametrize("chapter", lies.CHAPTERS)
def test_a_seed_gives_the_same_lies(chapter):
    for number in range(1, 30):
        one, again = (lies.lie(number, 5, chapter, ME) for _ in range(2))
        assert (one.kind, one.messages, one.lines) == (again.kind, again.messages, again.lines)
    assert [lies.lie(n, 5, chapter, ME).messages for n in range(1, 30)] != \
        [lies.lie(n, 6, chapter, ME).messages for n in range(1, 30)]


@pytest.mark.parametrize("chapter", lies.CHAPTERS)
def test_every_kind_is_drawn_and_each_is_a_lie(chapter):
    drawn = {lies.lie(n, 0, chapter, ME).kind for n in range(1, 400)}
    assert drawn == set(lies.kinds(chapter))
    honest = lies.Form(chapter, ME).bytes() if chapter != "18" else None
    for kind in lies.kinds(chapter):
        one = lies.lie(1, 0, chapter, ME, kind)
        assert one.messages and one.lines >= 1
        if kind != "mid-run":  # a plausible CONNECT first, then the lie
            assert honest not in one.messages, kind


def test_the_plausible_connect_is_what_the_chapter_packs():
    """The lies start from the chapter's own format: the honest form, packed by us, reads
    back with the chapter's own structs."""
    request = lies.Form("07", ME).bytes()
    address, body, why = connect.unpack(request, 7)
    assert address == ME.address and why is None
    header = lies.module(7).HEADER
    assert connect.unpack_from(header, body)[1:5] == (lies.PAGE, lies.ITERS, 1, 2)


def test_page_runs_are_counted_against_the_message_before_they_are_read():
    runs, packed = connect.pack_pages([0, 1, 2])
    with pytest.raises(ValueError, match="its 1 page runs make it 8"):
        connect.unpack_pages(packed + b"x", 0, runs, 4096)
    with pytest.raises(ValueError, match="page runs make it"):
        connect.unpack_pages(packed, 0, (1 << 32) - 1, 4096)
    huge = connect.RUN.pack(0, (1 << 32) - 1)  # one run of 4 billion pages: never a list
    with pytest.raises(ValueError, match="more than half this host's memory"):
        connect.unpack_pages(huge, 0, 1, 4096)


def test_a_landed_must_confirm_every_write():
    connect.check_landed(64, 64)
    with pytest.raises(ValueError, match="the client says 63 WRITEs landed, of 64"):
        connect.check_landed(63, 64)


@pytest.mark.parametrize("provider,bad", [
    ("shm", b"fi_shm://999999999:0:0\0"),  # no such region: 1.17 keeps it in its map
    ("shm", b"fi_shm://../x\0"),
    ("tcp", b"\x17\x00" + bytes(14)),      # not AF_INET: the AV's length goes to 0
])
def test_a_peer_address_is_checked_before_the_av_takes_it(provider, bad):
    info, _ = fi.pick(provider, lib.FI_MSG)
    with fi.Closer() as own:
        _, _, av, ep = fi.open_endpoint(own, info)
        with pytest.raises(ValueError):
            fi.av_insert(av, bad, info)
        fi.av_insert(av, fi.getname(ep), info)  # the AV still takes a real one


# Kinds that broke a server before it was fixed, per chapter: each is told, answered in one
# line, and the honest client succeeds after them.
BROKE = [
    ("05", "shm", ["truncated", "nobody", "mid-run", "chapter"]),  # SIGSEGV; exit on a short one
    ("06", "tcp", ["padded", "largest"]),   # FI_ETRUNC on tcp; a source of 2^64 bytes
    ("07", "shm", ["mid-run", "counts", "negative"]),  # a LANDED that lied; 2^64 WRITEs
    ("09", "shm", ["largest", "counts"]),   # 65535 x 65535 lanes before the pages were read
    ("18", "shm", ["stray", "truncated"]),  # the decoder ended on a message not a request
    ("18", "tcp", ["nobody"]),  # a garbage sockaddr in tcp's AV: every later insert failed
    ("10", "tcp", ["nobody"]),  # the same in a lane's AV
]


@pytest.mark.long
@pytest.mark.parametrize("chapter,provider,kinds", BROKE, ids=[f"{b[0]}-{b[1]}" for b in BROKE])
def test_lies_that_broke_a_server_get_one_line(chapter, provider, kinds):
    server, cell = fz.Server(chapter, provider), fz.Cell(chapter, provider)
    try:
        assert server.address, server.err
        for number, kind in enumerate(kinds, 1):
            for seed in range(3):  # a kind's variants
                problems = fz.tell_one(server, chapter, provider, seed, number, cell, kind)
                assert not problems, (kind, cell.tried[-1][0].what, problems)
        assert fz.honest(server, chapter, provider) == []
    finally:
        assert server.stop() is None


@pytest.mark.long
def test_a_message_longer_than_the_inbox_is_one_line():
    """tcp fails a receive too short for its message (FI_ETRUNC): the server says so in one
    line and serves the next client (shm spins in the provider instead: lies.Me.oversize)."""
    server = fz.Server("06", "tcp")
    try:
        one = lies.Lie(1, "06", "padded", "past one SEND", [])
        with fi.Closer() as own:
            liar = fz.Liar(own, "tcp", "06")
            assert liar.send(fz.destination(liar, "06", server.address), bytes(liar.size + 1),
                             10.0)
            assert fz.answer(server, 0, one, liar) == []
        assert server.err == [f"ignored a message longer than {liar.size} bytes (one SEND "
                              "here)\n"]
        assert fz.honest(server, "06", "tcp") == []
    finally:
        assert server.stop() is None


def fuzz(*args, seconds):
    budget = Budget(seconds)
    return budget.run([*FUZZ, *args], env=local_env())


def test_eight_lies_at_one_chapter_then_an_honest_client():
    """The fast tier's run (SETTLE after each lie is most of it); the long tier has 1100."""
    cell = fz.run_cell("06", "shm", 3, range(1, 9), 8)
    assert not cell.problems and cell.honest == 1, cell.problems
    assert fz.figure([cell]) == "lies 8, survived 8/8", [p for _, p in cell.tried if p]


@pytest.mark.long
def test_one_lie_at_a_running_server_as_chaos_sends_it():
    server = fz.Server("07", "shm")
    try:
        done = subprocess.run([*FUZZ, "--address", server.address.hex(), "--chapter", "07",
                               "-p", "shm", "--seed", "1", "--lie", "4"], capture_output=True,
                              text=True, env=local_env(), cwd=ROOT, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("lie 4 (")
    finally:
        assert server.stop() is None


@pytest.mark.long
def test_every_chapter_on_shm_and_tcp_survives_fifty_lies():
    done = fuzz("--lies", "50", "--every", "25", "--seed", "11", seconds=1500)
    # what failed is printed before the table of cells, which would fill the message alone
    assert done.returncode == 0, re.split(r"\n *cell ", done.stdout)[0][-3000:] + done.stderr
    assert "lies 1100, survived 1100/1100" in done.stdout


def test_the_flags_are_checked(capsys):
    with pytest.raises(SystemExit) as e:
        fz.main(["--address", "00ff"])
    assert e.value.code == 2 and "needs one --chapter" in capsys.readouterr().err

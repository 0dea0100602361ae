"""The transfer engine (common/transfer) on shm and tcp: WRITEs checked byte for byte
between two ranks with one and two virtual NICs and both spreads, immediates counted in
any order, scatter and barrier on 2, 4 and 8 ranks, refusals in one line before anything
is posted, a peer killed mid-transfer seen by the survivor, injected WRITEs, the worker's
pinning, torch tensors (CPU, and CUDA where there is a GPU), and the GPUDirect flush that
expect() makes where a NIC writes GPU memory (faked on the host, real on a GPU)."""
import errno
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import common.fabric as fi
from common.fabric import lib
from common.gpu import cuda_driver
from common.chapter_pair import ROOT, local_env
from tests.support.budget import Budget
from tests.support.gpu import needs_gpu
from tests.support.transfer_launch import launched

transfer = pytest.importorskip("common.transfer")  # skipped only if the worker is not built
from common.transfer import Engine, TransferError  # noqa: E402


@pytest.mark.long
@pytest.mark.parametrize("provider,nics,spread", [
    ("shm", 1, "round-robin"), ("shm", 2, "round-robin"), ("shm", 2, "per-peer"),
    ("tcp", 2, "round-robin"), ("tcp", 2, "per-peer")])
def test_writes_arrive_byte_for_byte_and_immediates_in_any_order(provider, nics, spread):
    done = launched(2, "pair", "-p", provider, "--nics", str(nics), "--spread", spread)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"{nics} virtual NIC" in out
    assert "[1] single WRITE: wrong bytes: 0" in out
    assert "[1] paged WRITEs: 256 pages: wrong bytes: 0" in out
    # expected in another order than written (10, 11, 12, 10, 13, 11), two batches each for 10, 11
    found = re.findall(r"^\[1\] expected (\d+) WRITEs with immediate (\d+)$", out, re.M)
    assert found == [("3", "12"), ("44", "11"), ("200", "13"), ("9", "10")]
    assert "[1] again: 0 of 1 WRITEs with immediate 10 arrived within 0.2 s" in out
    assert "[0] wrote 257 WRITEs; stats {'posted': 257, 'completed': 257" in out
    assert "[0] control: rank 1 saw 0 wrong bytes; unknown sender -> None" in out
    assert "[1] control reply: bye" in out


@pytest.mark.long
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_scatter_and_barriers_on_groups(ranks, provider):
    done = launched(ranks, "group", "-p", provider)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for r in range(ranks):
        assert f"[{r}] scatter of 3000 bytes from {ranks} ranks: wrong bytes: 0" in out, out
        # a scatter to every rank and 3 barriers: 4 WRITEs out and 4 in per member
        assert re.search(rf"^\[{r}\] barriers: 3 passed; stats \{{'posted': {4 * ranks}, "
                         rf"'completed': {4 * ranks}, 'eagain': \d+, 'arrived': {4 * ranks}",
                         out, re.M), out


@pytest.mark.long
@pytest.mark.parametrize("watch", [False, True], ids=["alone", "watching-the-group"])
def test_a_peer_killed_mid_transfer_is_seen(provider, watch):
    """Without watching the group, the survivor sees it by itself: tcp fails the WRITEs,
    shm's never complete (a timeout); watching, at once (PeerGone). A grace longer than
    the timeout: the launcher's SIGTERM would end the survivor before it says so."""
    done = launched(2, "kill", "-p", provider, *(["--watch"] * watch), timeout=2, grace=60)
    assert done.returncode != 0
    assert "[1] got the first round; dying" in done.stdout, done.stdout + done.stderr
    line = re.search(r"^\[0\] survivor: .*$", done.stdout, re.M)
    assert line, done.stdout + done.stderr
    if watch:  # the rendezvous says it when the connection closes or the launcher reaps it
        assert re.search(r"PeerGone: stopping: rank 1 (is gone|was killed by SIGKILL)|"
                         "TransferError", line[0]), line[0]
    else:
        assert ("TransferError: WRITE on NIC 0 failed" in line[0]
                or "TimeoutError: 2048 WRITEs not completed" in line[0]), line[0]
    assert "rank 1 was killed by SIGKILL" in done.stderr


@pytest.mark.long
def test_a_ctrl_c_while_writes_arrive_ends_by_the_interrupt_not_a_crash():
    """A rank interrupted while its peer's WRITEs of 8 MiB stream into it. On 1.17's tcp
    (rxm over tcp), closing the endpoint they arrive on crashed the process in rxm's
    fi_close (SIGSEGV, 3 runs in 4 here; chapter 18's decoder under the fault run): those
    objects now stay open once a signal came (common/fabric/calls.py, _left_open)."""
    for _ in range(3):
        done = launched(2, "interrupt", "-p", "tcp", timeout=5, grace=30)
        assert "[1] interrupting myself" in done.stdout, done.stdout + done.stderr
        assert "launch: rank 1 was killed by SIGINT" in done.stderr, done.stderr[-3000:]


# --- one process: refusals, the arrival table ---------------------------------------------

@pytest.fixture
def engine():
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", nics=2, timeout=Budget(10).seconds)
        yield own, eng


def one_line(excinfo, pattern):
    text = str(excinfo.value)
    assert "\n" not in text and pattern in text, text


def test_bad_input_is_refused_in_one_line_and_nothing_is_posted(engine):
    own, eng = engine
    me = eng.connect(eng.address())
    src = eng.register(np.zeros(8 * 4096, np.uint8))
    dst = eng.remote(eng.register(np.zeros(4 * 4096, np.uint8)).descriptor())
    other = Engine(own, provider="shm", nics=2, timeout=5)
    foreign = other.register(np.zeros(4096, np.uint8))
    one_nic = Engine(own, provider="shm", nics=1, timeout=5)
    cases = [
        (lambda: eng.remote(b"\x00" * 10), "not a region descriptor (10 bytes)"),
        (lambda: eng.remote(src.descriptor()[:-3]), "not a region descriptor"),
        (lambda: eng.remote(one_nic.register(np.zeros(64, np.uint8)).descriptor()),
         "registered on 1 NICs, this engine has 2"),
        (lambda: eng.connect(one_nic.address()), "that engine has 1 NICs and this one 2"),
        (lambda: eng.write_pages(me, src, [0, 8], dst, [0, 1], 4096), "source page 8 is out of range"),
        (lambda: eng.write_pages(me, src, [0, 1], dst, [3, 4], 4096),
         "destination page 4 is out of range"),
        (lambda: eng.write_pages(me, src, [0], dst, [0, 1], 4096), "1 source pages but 2"),
        (lambda: eng.write_pages(me, src, [-1], dst, [0], 4096), "negative page"),
        (lambda: eng.write_pages(me, src, [0], dst, [0], 0), "page_size must be a positive"),
        (lambda: eng.write(me, src, 0, dst, 0, 1, imm=1 << 64), "does not fit the 8 bytes"),
        (lambda: eng.write(me, src, 0, dst, 0, 1, imm=-1), "does not fit"),
        (lambda: eng.write(me, src, 0, dst, 0, 0), "length must be 1 to"),
        (lambda: eng.write(me, src, 0, dst, 1, 4 * 4096), "destination bytes 1..16385 are out"),
        (lambda: eng.write(me, src, 8 * 4096, dst, 0, 1), "source bytes 32768..32769"),
        (lambda: eng.write(me, foreign, 0, dst, 0, 1), "a region registered by this engine"),
        (lambda: eng.write(me, src, 0, src, 0, 1), "must be a RemoteRegion"),
        (lambda: other.write(me, foreign, 0, dst, 0, 1), "not one of this engine's"),
        (lambda: eng.send(me, b"x" * (fi.FALLBACK_MTU + 1)), "at most"),
        (lambda: eng.write_list(me, src, [0, 1], dst, [0], [1, 1]), "2 source offsets, 1 "),
        (lambda: eng.write_list(me, src, [0, 1], dst, [0, 9], [1, 0]), "length must be 1 to"),
        (lambda: eng.write_list(me, src, [0], dst, [4 * 4096 - 2], [3]),
         "destination bytes 16382..16385 are out"),
        (lambda: eng.write_list(me, src, [0], dst, [0], [-3]), "lengths has a negative"),
        (lambda: eng.register([1, 2, 3]), "cannot register a list"),
        (lambda: eng.register(np.zeros((4, 4), np.uint8)[:, 1]), "must be contiguous"),
    ]
    for call, pattern in cases:
        with pytest.raises(ValueError) as excinfo:
            call()
        one_line(excinfo, pattern)
    assert eng.stats()["posted"] == 0


def test_a_callers_mistake_is_said_as_what_the_caller_did():
    """For a program using the engine as a library: what it passed and what to pass, not
    what a reader of a chapter should paste, nor a provider's error or a timeout (an shm
    engine took a tcp engine's address and its WRITEs never went)."""
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        tcp = Engine(own, provider="tcp", timeout=Budget(10).seconds)
        me = eng.connect(eng.address())
        descriptor = eng.register(np.zeros(64, np.uint8)).descriptor()
        cases = [
            (lambda: eng.connect(b"junk"), "not an engine's address (4 bytes): pass the bytes "
             "of another engine's Engine.address(), whole and unchanged"),
            (lambda: eng.connect(eng.address().hex().encode()), "bytes.fromhex"),
            (lambda: eng.connect(eng.address().hex()),
             "an engine's address is bytes (Engine.address()), not a str"),
            (lambda: eng.remote(descriptor.hex()),
             "a region descriptor is bytes (Region.descriptor()), not a str"),
            (lambda: eng.remote(descriptor[:-1]), f"not a region descriptor "
             f"({len(descriptor) - 1} bytes): pass the bytes of a Region.descriptor(), whole "
             "and unchanged"),
            (lambda: eng.connect(tcp.address()),
             "that engine runs on tcp and this one on shm: give both the same provider"),
            (lambda: tcp.connect(eng.address()),
             "that engine runs on shm and this one on tcp: give both the same provider"),
            (lambda: eng.send(me, bytes(eng.max_send + 1)), "(Engine.max_send)"),
            (lambda: eng.register(np.array([None, 1], object)),
             "cannot register an array of Python objects (dtype object)"),
        ]
        for call, said in cases:
            with pytest.raises(ValueError) as excinfo:
                call()
            one_line(excinfo, said)
            assert "server" not in str(excinfo.value), excinfo.value


@pytest.mark.parametrize("provider", ["shm", pytest.param("tcp", marks=pytest.mark.long)])
def test_the_packages_example_of_two_processes_runs(provider):
    """common/transfer/example.py, which README.md points a new user to: the writer's
    pages land in the reader's memory, the reader counts them by their immediate and
    connects back to the address that came before it had any peer."""
    done = Budget(60).run([sys.executable, "-m", "common.transfer.example", "-p", provider,
                           "--timeout", f"{Budget(10).seconds:g}"], cwd=ROOT, env=local_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "writer: the reader says: 64 pages arrived, 0 wrong bytes",
        "reader: 64 pages, 0 wrong bytes; the writer's first message came from peer None, as "
        "none was connected; writer exit 0"], done.stdout + done.stderr


class SendsNothing:
    """The cffi lib, but fi_sendmsg answers `rc` and sends nothing."""

    def __init__(self, rc):
        self.rc = rc

    def __getattr__(self, name):
        return (lambda *_: self.rc) if name == "fi_sendmsg" else getattr(lib, name)


@pytest.mark.long
@pytest.mark.parametrize("rc,line", [
    (-lib.FI_EAGAIN, "no control message to peer 0 could be sent within 0.5 s (the provider's "
                     "queue stayed full): is the peer still running?"),
    (0, "a control message to peer 0 did not complete within 0.5 s: is the peer still "
        "running?"),
])
def test_a_control_message_that_does_not_go_is_said_plainly(monkeypatch, rc, line):
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=0.5)
        me = eng.connect(eng.address())
        monkeypatch.setattr(transfer.control, "lib", SendsNothing(rc))
        with pytest.raises(TimeoutError) as excinfo:
            eng.send(me, b"hello")
    assert str(excinfo.value) == line


def test_bad_engine_arguments_are_refused_before_anything_opens():
    with fi.Closer() as own:
        for kwargs, pattern in [({"spread": "sideways"}, "spread must be one of"),
                                ({"nics": 0}, "nics must be at least 1"),
                                ({"peers": 0}, "peers must be a positive integer"),
                                ({"provider": "nope"}, "unknown provider 'nope'"),
                                ({"gpu": 99}, "")]:
            with pytest.raises(ValueError) as excinfo:
                Engine(own, provider=kwargs.pop("provider", "shm"), **kwargs)
            one_line(excinfo, pattern)


def test_each_nics_cq_has_room_for_the_immediates_of_the_peers_writing_into_it(monkeypatch):
    """Issue 46, 7: a peer's WRITE with an immediate takes an entry of our CQ (and no posted
    receive: mode 0); the CQs were sized for our own WRITEs and receives only. With
    peers=3, three engines' windows of WRITEs in flight besides ours."""
    sizes, opened = [], fi.open_endpoint

    def open_endpoint(own, info, cq_size=None, **kwargs):
        sizes.append(cq_size)
        return opened(own, info, cq_size=cq_size, **kwargs)
    monkeypatch.setattr(fi, "open_endpoint", open_endpoint)
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", nics=2, timeout=10, peers=3)
        slots, rx = fi.in_flight(eng.infos[0]), eng.infos[0].rx_attr.size
    assert sizes == [4 * slots + rx] * 2, (sizes, slots, rx)
    assert fi.cq_size_for(eng.infos[0], 10, incoming=7) == 17 + rx


def test_the_control_endpoint_is_opened_with_its_own_nics_entry():
    """Issue 46, 1: on a ConnectX host the control endpoint went on NIC 0's domain with the
    head fi_info (another NIC's: rxm, then verbs, refuse it). Under FABRIC_RULES=verbs the
    virtual NICs differ as a host's do, the head entry being none of them: a control
    message goes only if its endpoint was opened with NIC 0's own entry."""
    program = ("import common.fabric as fi\n"
               "from common.transfer import Engine\n"
               "with fi.Closer() as own:\n"
               "    eng = Engine(own, provider='shm', nics=2, timeout=10)\n"
               "    me = eng.connect(eng.address())\n"
               "    eng.send(me, b'to myself')\n"
               "    print('control:', eng.recv()[1], '|', eng.nics)\n")
    done = Budget(60).run([sys.executable, "-c", program], cwd=ROOT,
                          env=local_env({"FABRIC_RULES": "verbs"}))
    assert done.returncode == 0, done.stderr
    assert "control: b'to myself' | 2 virtual NICs" in done.stdout, done.stdout


def test_registered_memory_lives_as_long_as_its_registration():
    """A region dropped by its caller stays registered until the engine closes, so the
    engine holds its array: a peer's WRITE never lands in freed memory."""
    import gc
    import weakref
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        array = np.zeros(4096, np.uint8)
        held = weakref.ref(array)
        eng.remote(eng.register(array).descriptor())
        del array
        gc.collect()
        assert held() is not None
    gc.collect()
    assert held() is None


@pytest.mark.parametrize("pages", [1, 64])
def test_a_commands_phases_are_in_order_and_add_up(engine, pages):
    """Transfer.phases: the worker's stamps (queued, first and last post, done) fall between
    the call and wait()'s return, in that order; one WRITE stamps its post twice."""
    _, eng = engine
    me = eng.connect(eng.address())
    src = eng.register(np.ones(64 * 4096, np.uint8))
    dst = eng.remote(eng.register(np.zeros(64 * 4096, np.uint8)).descriptor())
    called = time.monotonic_ns()
    t = eng.write_pages(me, src, range(pages), dst, range(pages), 4096, imm=3).wait()
    returned = time.monotonic_ns()
    phases = t.phases(called, returned)
    assert list(phases) == list(transfer.PHASES)
    assert all(took >= 0 for took in phases.values()), phases
    assert abs(sum(phases.values()) - (returned - called) * 1e-9) < 1e-6
    if pages == 1:
        assert phases["posting"] == 0


def test_a_list_of_writes_of_several_lengths_and_a_signal(engine):
    _, eng = engine
    me = eng.connect(eng.address())
    data = np.random.default_rng(5).integers(0, 256, 10000, dtype=np.uint8)
    into = np.zeros(10000, np.uint8)
    src, dst = eng.register(data), eng.remote(eng.register(into).descriptor())
    eng.write_list(me, src, [0, 100, 9000], dst, [5000, 10, 9990], [50, 3000, 10],
                   imm=7).wait()
    eng.expect(7, 3)
    want = np.zeros(10000, np.uint8)
    want[5000:5050], want[10:3010], want[9990:] = data[:50], data[100:3100], data[9000:9010]
    assert int(np.count_nonzero(into != want)) == 0
    eng.signal(me, 9).wait()
    eng.signal(me, 9).wait()  # done here does not mean counted over there yet (a busy
    eng.expect(9, 1)          # machine's run saw 1 of 2): each expect takes what it asks,
    eng.expect(9, 1)          # so the second finds the other signal, not a timeout
    assert eng.arrived(9) == 0


def test_a_prepared_command_writes_the_same_pages_shifted_each_time(engine):
    """prepare_pages once, then write() as a KV cache's layers go: layer l's pages are
    layer 0's shifted by l pages a side; every write lands where write_pages would put it.
    prepare_list likewise, shifted by bytes."""
    _, eng = engine
    me = eng.connect(eng.address())
    page, layers, pages = 256, 4, 5
    data, src, into, dst = regions(eng, page * pages * layers, 31)
    order = np.array([3, 0, 4, 1, 2])
    prepared = eng.prepare_pages(me, src, np.arange(pages), dst, order, page)
    for layer in range(layers):
        prepared.write(imm=40 + layer, src_shift=layer * pages, dst_shift=layer * pages)
    for layer in range(layers):
        eng.expect(40 + layer, pages)
    want = data.reshape(layers, pages, page)
    assert int(np.count_nonzero(into.reshape(layers, pages, page)[:, order] != want)) == 0
    listed = eng.prepare_list(me, src, [0, 700], dst, [10, 300], [100, 50])
    listed.write(imm=50, src_shift=1, dst_shift=2).wait()
    eng.expect(50, 2)
    assert bytes(into[12:112]) == bytes(data[1:101])
    assert bytes(into[302:352]) == bytes(data[701:751])


def test_a_prepared_command_refuses_bad_pages_and_shifts_in_one_line(engine):
    """Its pages are checked when it is made, a shift and an immediate at each write(): a
    ValueError of one line, nothing posted."""
    _, eng = engine
    me = eng.connect(eng.address())
    _, src, _, dst = regions(eng, 8 * 1024, 32)
    with pytest.raises(ValueError) as e:
        eng.prepare_pages(me, src, [0, 8], dst, [0, 1], 1024)
    one_line(e, "source page 8 is out of range")
    prepared = eng.prepare_pages(me, src, [0, 6], dst, [1, 2], 1024)
    posted = eng.stats()["posted"]
    for kw, said in [({"src_shift": 2}, "src_shift 2 puts bytes up to 9216 in a region of 8192"),
                     ({"dst_shift": 6}, "dst_shift 6 puts bytes up to 9216"),
                     ({"dst_shift": -1}, "dst_shift must be a non-negative integer"),
                     ({"src_shift": 1.5}, "src_shift must be a non-negative integer"),
                     ({"imm": -3}, "imm -3 does not fit")]:
        with pytest.raises(ValueError) as e:
            prepared.write(**kw)
        one_line(e, said)
    assert eng.stats()["posted"] == posted
    prepared.write(imm=60, src_shift=1, dst_shift=5).wait()
    eng.expect(60, 2)


def test_an_engine_used_after_it_closed_says_so_in_one_line():
    """Every call after the engine's Closer ran but arrived() and stats(), which say what
    was counted: not the worker's last return code as a failure ("Success"), nor the
    provider's answer on a closed domain (register: "fi_mr_regattr: Invalid argument"),
    nor a crash (connect and send reached closed AVs and endpoints), but that the engine
    is closed. An expect() whose WRITEs came before the close is refused too."""
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        other = Engine(own, provider="shm", timeout=Budget(10).seconds).address()
        me = eng.connect(eng.address())
        _, src, _, dst = regions(eng, 4096, 33)
        prepared = eng.prepare_pages(me, src, [0], dst, [0], 4096)
        descriptor = src.descriptor()
        eng.signal(me, 2).wait()
        deadline = time.monotonic() + Budget(10).seconds
        while eng.arrived(2) < 1 and time.monotonic() < deadline:  # counted, not taken
            time.sleep(0.01)
    group = eng.group([me])
    for call in (lambda: eng.write_pages(me, src, [0], dst, [0], 4096, imm=1),
                 lambda: eng.write(me, src, 0, dst, 0, 8),
                 lambda: eng.write_list(me, src, [0], dst, [0], [8]),
                 lambda: eng.prepare_pages(me, src, [0], dst, [0], 4096),
                 lambda: eng.prepare_list(me, src, [0], dst, [0], [8]),
                 lambda: prepared.write(imm=1), lambda: eng.expect(1, 1, 1),
                 lambda: eng.expect(2, 1, 1), lambda: eng.signal(me, 3),
                 lambda: eng.register(np.zeros(64, np.uint8)), lambda: eng.remote(descriptor),
                 lambda: eng.address(), lambda: eng.connect(other),
                 lambda: eng.send(me, b"hello"), lambda: eng.recv(1),
                 lambda: group.scatter(src, [dst], 8), lambda: group.barrier(4, 1)):
        with pytest.raises(TransferError) as e:
            call()
        one_line(e, "this engine is closed (its Closer has run)")
    assert eng.stats()["posted"] == 1 and eng.arrived(2) == 1


def test_the_inject_size_is_the_smallest_nics_and_none_on_efa():
    """The smallest NIC's tx_attr.inject_size; none on efa-direct (no WRITE inject) nor on
    efa's RDM endpoint (its WRITE limit may shrink below tx_attr.inject_size)."""
    from tests.support import fake_info
    head = fake_info.infos(fake_info.Entry("a", fabric="shm"), fake_info.Entry("b", fabric="shm"),
                           fake_info.Entry("a", fabric="efa-direct"),
                           fake_info.Entry("a", fabric="efa"))
    one, other, direct, rdm = fi.each(head)
    for info, size in ((one, 4000), (other, 3000), (direct, 32), (rdm, 4000)):
        info.tx_attr.inject_size = size
    assert transfer.inject_size([one]) == 4000 and transfer.inject_size([one, other]) == 3000
    assert transfer.inject_size([direct]) == 0 and transfer.inject_size([rdm]) == 0


def test_a_write_with_an_immediate_is_cut_at_efas_segment():
    """Issue 46, 2: efa's RDM fabric lists max_msg_size UINT64_MAX, cuts a WRITE into 1 GiB
    segments and puts the immediate on each; chapter 19 cut WRITEs by max_msg_size. Under
    efa's rules on shm (whose own limit is far above) the engine's cut is the segment."""
    program = ("import common.fabric as fi\n"
               "from common.transfer import Engine\n"
               "with fi.Closer() as own:\n"
               "    print('max_write', Engine(own, provider='shm', timeout=10).max_write)\n")
    for rules, cut in (("efa", 1 << 30), ("efa-direct", 1 << 30), ("verbs", None)):
        done = Budget(60).run([sys.executable, "-c", program], cwd=ROOT,
                              env=local_env({"FABRIC_RULES": rules}))
        assert done.returncode == 0, done.stderr
        found = int(done.stdout.split()[-1])
        assert found == cut if cut else found > 1 << 30, (rules, found)


def test_efas_rdm_fabric_writes_at_most_a_segment_and_the_others_their_max_msg_size():
    from tests.support import fake_info
    head = fake_info.infos(fake_info.Entry("a", fabric="efa", max_msg_size=(1 << 64) - 1),
                           fake_info.Entry("a", fabric="efa-direct", max_msg_size=1 << 30),
                           fake_info.Entry("m", fabric="IB-0xfe80000000000000",
                                           provider="verbs;ofi_rxm", max_msg_size=1 << 31))
    assert [fi.max_write(i) for i in fi.each(head)] == [1 << 30, 1 << 30, 1 << 31]


@pytest.fixture
def to_itself(provider):
    """(engine, peer: itself) on `provider` (one NIC) for injected WRITEs."""
    with fi.Closer() as own:
        eng = Engine(own, provider=provider, timeout=Budget(10).seconds)
        yield eng, eng.connect(eng.address())


def regions(eng, size, seed):
    """(seeded bytes, their region, zeros, a RemoteRegion of them)."""
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    into = np.zeros(size, np.uint8)
    return data, eng.register(data), into, eng.remote(eng.register(into).descriptor())


def test_injected_pages_arrive_byte_for_byte_with_their_immediates(to_itself):
    eng, me = to_itself
    page, pages = eng.inject_size, 300
    assert page >= 64  # shm 4 KiB, tcp 64 B
    data, src, into, dst = regions(eng, page * pages, 11)
    order = np.random.default_rng(12).permutation(pages)
    t = eng.write_pages(me, src, np.arange(pages), dst, order, page, imm=21, inject=True)
    t.wait()
    eng.expect(21, pages)  # done only says the source was copied; these say they arrived
    assert int(np.count_nonzero(into.reshape(pages, page)[order]
                                != data.reshape(pages, page))) == 0
    stats = eng.stats()
    assert stats["injected"] == stats["posted"] == stats["completed"] == pages


def test_a_command_of_lengths_above_and_below_the_inject_size_completes(to_itself):
    eng, me = to_itself
    cut = eng.inject_size
    lengths = np.array([cut, cut + 1, 1, 3 * cut, cut - 1, 2 * cut] * 20, np.uint64)
    ends = np.cumsum(lengths)
    offsets = ends - lengths
    data, src, into, dst = regions(eng, int(ends[-1]) + 100, 13)
    eng.write_list(me, src, offsets, dst, offsets + 100, lengths, imm=22, inject=True).wait()
    eng.expect(22, len(lengths))
    assert int(np.count_nonzero(into[100:] != data[:-100])) == 0
    stats = eng.stats()
    assert stats["injected"] == int(np.count_nonzero(lengths <= cut)) == 60
    assert stats["posted"] == stats["completed"] == len(lengths)


def test_inject_on_pages_too_large_to_inject_posts_them_as_usual(to_itself):
    eng, me = to_itself
    page, pages = 2 * eng.inject_size, 50
    data, src, into, dst = regions(eng, page * pages, 14)
    eng.write_pages(me, src, np.arange(pages), dst, np.arange(pages), page, imm=23,
                    inject=True).wait()
    eng.expect(23, pages)
    assert int(np.count_nonzero(into != data)) == 0
    assert eng.stats()["injected"] == 0 and eng.stats()["completed"] == pages


# A CQ whose every read says an operation failed, with no context: what a provider writes
# for an injected WRITE of ours (or a peer's WRITE) that failed. fi_cq_read and
# fi_cq_readerr are static inline: they call through the CQ's table, which this fills.
ERROR_CQ = r"""
#include <stdio.h>
#include <rdma/fabric.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
static ssize_t error_read(struct fid_cq *cq, void *buf, size_t count) { return -FI_EAVAIL; }
static ssize_t error_readerr(struct fid_cq *cq, struct fi_cq_err_entry *e, uint64_t flags)
{
    e->op_context = NULL;
    e->err = FI_EIO;
    return 1;
}
static const char *error_text(struct fid_cq *cq, int prov_errno, const void *data, char *buf,
                              size_t len)
{
    snprintf(buf, len, "the target has no such key");
    return buf;
}
static struct fi_ops_cq ops = { .size = sizeof ops, .read = error_read,
                                .readerr = error_readerr, .strerror = error_text };
static struct fid_cq cq = { .ops = &ops };
struct fid_cq *error_cq(void) { return &cq; }
"""


@pytest.fixture(scope="module")
def error_cq(tmp_path_factory):
    """The address of that CQ (compiled with the C compiler against the binding's headers)."""
    import os
    from cffi import FFI
    from common.fabric._build import _flags
    where = tmp_path_factory.mktemp("error_cq")
    (where / "error_cq.c").write_text(ERROR_CQ)
    cc = subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o",
                         str(where / "error_cq.so"), str(where / "error_cq.c"),
                         *[f"-I{d}" for d in _flags()["include_dirs"]]],
                        capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    ffi = FFI()
    ffi.cdef("void *error_cq(void);")
    lib = ffi.dlopen(str(where / "error_cq.so"))
    yield int(ffi.cast("uintptr_t", lib.error_cq()))


@pytest.mark.parametrize("injected", [0, 1])
def test_an_error_entry_with_no_context_fails_the_engine_once_it_injected(error_cq, injected):
    """Before any injected WRITE it is a peer's WRITE that failed here (counted, the worker
    goes on); after one, maybe ours, which no command waits for: the worker stops and the
    engine's next call raises the provider's text in one line. Never a NULL dereference."""
    import threading
    from types import SimpleNamespace
    from common.transfer._native import ffi, lib as native
    w = ffi.new("struct tx_worker *")
    keep = [ffi.new("struct fid_ep *[1]"), ffi.new("struct fid_cq *[]", [
        ffi.cast("struct fid_cq *", error_cq)]), ffi.new("struct tx_command *[4]"),
        ffi.new("uint64_t[4]"), ffi.new("uint64_t[4]"), ffi.new("uint8_t[4]")]
    w.eps, w.cqs, w.ring, w.imm_keys, w.imm_counts, w.imm_used = keep
    w.nics, w.slots, w.ring_size, w.imm_size, w.injected = 1, 4, 4, 4, injected
    rc = []
    worker = threading.Thread(target=lambda: rc.append(native.tx_run(w)), daemon=True)
    worker.start()
    worker.join(Budget(2).seconds if injected else 0.2)
    w.stop = 1  # a worker that goes on ends here
    worker.join(Budget(10).seconds)
    native.tx_free(w)
    assert ffi.string(w.remote_error) == b"the target has no such key"
    if not injected:
        assert rc == [0] and w.remote_errors > 0 and w.failed_call == 0
        return
    assert rc == [-errno.EIO] and w.failed_call == 5 and w.remote_errors == 0
    failure = Engine._failure(SimpleNamespace(error=None, _w=w, rc=rc[0]))
    assert isinstance(failure, TransferError)
    assert str(failure).startswith("the transfer worker stopped on NIC 0: an error for no "
                                   "WRITE in flight after injected WRITEs (the target has no "
                                   "such key): "), str(failure)
    assert "\n" not in str(failure)


def test_torch_tensors_are_registered_without_a_copy(engine):
    """A WRITE from one torch tensor into another (run with torch 2.13's CPU build; skipped
    where there is no torch)."""
    torch = pytest.importorskip("torch")
    _, eng = engine
    me = eng.connect(eng.address())
    src = torch.arange(8192).to(torch.uint8)
    dst = torch.zeros(8192, dtype=torch.uint8)
    region, into = eng.register(src), eng.remote(eng.register(dst).descriptor())
    assert region.ptr == src.data_ptr()  # not a copy
    eng.write(me, region, 100, into, 0, 8000, imm=3).wait()
    eng.expect(3, 1)
    assert torch.equal(dst[:8000], src[100:8100]) and int(dst[8000:].count_nonzero()) == 0
    with pytest.raises(ValueError, match="must be contiguous"):
        eng.register(torch.zeros((4, 4), dtype=torch.uint8)[:, 1])


def test_the_worker_runs_on_the_cores_it_is_given(monkeypatch):
    """Chapter 12's pinning without a GPU: the worker thread takes the cores worker_cores
    picks (here the first one this process may use), the caller keeps its own."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("one core: a pinned worker and a free one look alike")
    monkeypatch.setattr(transfer.engine, "worker_cores", lambda gpu: {allowed[0]})
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        eng.signal(eng.connect(eng.address()), 1).wait()  # the worker has started its loop
        assert os.sched_getaffinity(eng._thread.native_id) == {allowed[0]}
        assert sorted(os.sched_getaffinity(0)) == allowed


@needs_gpu
def test_a_gpu_engine_runs_near_its_gpu_and_writes_torch_cuda_tensors():
    """On a GPU machine, two ranks on GPU 0: torch CUDA tensors registered without a copy
    and written page by page, each worker on cores of the GPU's NUMA node."""
    pytest.importorskip("torch")
    done = launched(2, "torch", "--gpu", "0", timeout=30)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert out.count("torch: registered without a copy: True") == 2, out
    assert "[1] torch: paged WRITEs: wrong bytes: 0" in out
    assert out.count("local cores: True") == 2, out


def test_writes_to_itself_and_the_arrival_table_when_full(monkeypatch):
    """A full table says so (the values that did not fit are lost, not miscounted)."""
    monkeypatch.setattr(transfer.engine, "IMM_TABLE", 4)
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        me = eng.connect(eng.address())
        data = np.random.default_rng(3).integers(0, 256, 6 * 512, dtype=np.uint8)
        src, out = eng.register(data), np.zeros(6 * 512, np.uint8)
        dst = eng.remote(eng.register(out).descriptor())
        for imm in range(6):
            eng.write_pages(me, src, [imm], dst, [5 - imm], 512, imm=100 + imm).wait()
        assert int(np.count_nonzero(out.reshape(6, 512)[::-1] != data.reshape(6, 512))) == 0
        for imm in range(4):
            eng.expect(100 + imm, 1, Budget(5).seconds)
        with pytest.raises(TimeoutError) as excinfo:
            eng.expect(104, 1, 0.2)
        one_line(excinfo, "0 of 1 WRITEs with immediate 104 arrived within 0.2 s; the arrival "
                          "table (4 values) is full, 2 arrivals of new values were lost")
        assert eng.stats()["arrived"] == 6


@pytest.mark.long
def test_a_failed_write_raises_the_providers_text():
    """A WRITE to a region whose key the peer never had: tcp closes the connection (its
    WRITEs fail with the provider's text) or the target drops it (shm): a TransferError or
    the timeout, never a success."""
    with fi.Closer() as own:
        budget = Budget(10)
        eng = Engine(own, provider="tcp", timeout=budget.grant(5))
        me = eng.connect(eng.address())
        src = eng.register(np.zeros(4096, np.uint8))
        good = eng.register(np.zeros(4096, np.uint8)).descriptor()
        bad = bytearray(good)
        bad[-8:] = (12345).to_bytes(8, "little")  # a key no registration has
        t = eng.write(me, src, 0, eng.remote(bytes(bad)), 0, 4096, imm=9)
        with pytest.raises((TransferError, TimeoutError)):
            t.wait(budget.grant(3))
            eng.expect(9, 1, budget.grant(3))


def test_a_failed_write_ends_a_program_in_one_line():
    """What a chapter's survivor raises when tcp fails its WRITEs to a peer that died: cli.run
    says it in one line, as any fabric error, not a traceback."""
    program = ("from common import cli\n"
               "from common.transfer import TransferError\n"
               "def main():\n"
               "    raise TransferError('WRITE on NIC 0 failed: Connection reset by peer')\n"
               "cli.run(main)\n")
    done = Budget(30).run([sys.executable, "-c", program], env=local_env(), cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "-c: error: WRITE on NIC 0 failed: Connection reset by peer"], done.stderr


# --- the GPUDirect flush: after the count arrived, before expect() returns -----------------

def recorded_flushes(monkeypatch, eng, rc=0):
    """cuda_driver.flush faked: each call's (scope, WRITEs with immediate 4 not yet taken)."""
    calls = []
    monkeypatch.setattr(cuda_driver, "flush",
                        lambda scope: calls.append((scope, eng.arrived(4))) or rc)
    return calls


def test_expect_flushes_once_the_count_arrived_and_never_on_a_timeout(engine, monkeypatch):
    """The flush scope set, as cuda_driver.flush_scope sets it for a NIC that writes into a
    GPU which does not order those writes: one flush per expect, once every WRITE came."""
    _, eng = engine
    eng.flush_scope = cuda_driver.OWNER
    calls = recorded_flushes(monkeypatch, eng)
    me = eng.connect(eng.address())
    eng.signal(me, 4).wait()
    with pytest.raises(TimeoutError):
        eng.expect(4, 2, 0.2)
    assert calls == []
    eng.signal(me, 4).wait()
    eng.expect(4, 2)
    assert calls == [(cuda_driver.OWNER, 2)] and eng.arrived(4) == 0


def test_a_failed_flush_is_one_line(engine, monkeypatch):
    _, eng = engine
    eng.flush_scope = cuda_driver.OWNER
    recorded_flushes(monkeypatch, eng, rc=999)
    monkeypatch.setattr(cuda_driver, "error_name", lambda rc: f"CUDA error {rc}")
    me = eng.connect(eng.address())
    eng.signal(me, 4).wait()
    with pytest.raises(TransferError) as excinfo:
        eng.expect(4, 1)
    one_line(excinfo, "1 WRITEs with immediate 4 arrived, but cuFlushGPUDirectRDMAWrites "
                      "failed: CUDA error 999")


def test_a_host_memory_engine_never_flushes(engine, monkeypatch):
    _, eng = engine
    assert eng.flush_scope is None
    calls = recorded_flushes(monkeypatch, eng)
    me = eng.connect(eng.address())
    eng.signal(me, 4).wait()
    eng.expect(4, 1)
    assert calls == []


def test_an_engine_on_a_device_that_neither_orders_nor_flushes_is_refused(monkeypatch):
    """The engine asks cuda_driver.flush_scope (faked: no GPU here) at construction."""
    asked = []

    def refuse(provider, gpu):
        asked.append((provider, gpu))
        raise ValueError("GPU 0 neither orders GPUDirect RDMA writes nor can flush them")
    monkeypatch.setattr(cuda_driver, "flush_scope", refuse)
    with fi.Closer() as own, pytest.raises(ValueError) as excinfo:
        Engine(own, provider="shm")
    one_line(excinfo, "GPU 0 neither orders GPUDirect RDMA writes")
    assert asked == [("shm", None)]


def test_the_flush_targets_the_current_context(monkeypatch):
    class Driver:
        def cuFlushGPUDirectRDMAWrites(self, target, scope):
            asked.append((target, scope))
            return 0
    asked = []
    monkeypatch.setattr(cuda_driver, "_loaded", [Driver()])
    assert cuda_driver.flush(cuda_driver.OWNER) == 0
    assert asked == [(cuda_driver.TARGET_CURRENT_CTX, cuda_driver.OWNER)]


@needs_gpu
def test_gpu_a_shm_engine_does_not_flush_and_the_real_flush_succeeds(monkeypatch):
    """On GPU 0: shm copies into GPU memory with CUDA itself, so its engine never flushes;
    with the scope set as for a NIC, expect's real cuFlushGPUDirectRDMAWrites must succeed
    (a no-op where the device orders the writes, "owner" on the H200s). The immediates come
    by signal (host memory): shm cannot map a process's own GPU memory by CUDA IPC."""
    flushed, real = [], cuda_driver.flush
    monkeypatch.setattr(cuda_driver, "flush", lambda scope: flushed.append(scope) or real(scope))
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", gpu=0, timeout=Budget(10).seconds)
        assert eng.flush_scope is None
        me = eng.connect(eng.address())
        eng.signal(me, 1).wait()
        eng.expect(1, 1)
        assert flushed == []
        eng.flush_scope = cuda_driver.OWNER
        eng.signal(me, 2).wait()
        eng.expect(2, 1)
        assert flushed == [cuda_driver.OWNER]


@pytest.mark.long
@pytest.mark.parametrize("inject, rules", [(False, None), (True, None), (True, "efa")],
                         ids=["completions", "inject", "inject-under-efa-rules"])
def test_the_benchmark_checks_its_pages_and_reports_each_case(tmp_path, inject, rules):
    """scripts/transfer_bench.py end to end, tiny: its figures are not judged, its data is;
    with --inject, shm's 4 KiB pages are injected and the record says so (under EFA's
    rules too: an injected WRITE's key is one fi_mr_key returned, common/fabric/rules.h)."""
    path = tmp_path / "bench.json"
    done = Budget(120).run([sys.executable, str(ROOT / "scripts" / "transfer_bench.py"), "-p",
                            "shm", "--page-sizes", "4K", "--pages", "10", "--repeats", "1",
                            "--no-fabtests", "--json", str(path), *["--inject"] * inject],
                           env=local_env(rules and {"FABRIC_RULES": rules}), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"4096 B x +10 pages: .* Gbps .*0 wrong bytes", done.stdout), done.stdout
    record = json.loads(path.read_text())
    assert record["inject"] is inject
    assert [(r["page_size"], r["pages"], r["wrong_bytes"], r["injected_last"])
            for r in record["runs"]] == [(4096, 10, 0, 10 * inject)]


@pytest.mark.long
def test_the_benchmark_streams_commands_and_counts_them_all(tmp_path):
    """--stream 3: three commands in flight per repeat; rank 1 waits for all their pages
    (one fewer would leave it waiting), and the figures count all of them."""
    path = tmp_path / "bench.json"
    done = Budget(120).run([sys.executable, str(ROOT / "scripts" / "transfer_bench.py"), "-p",
                            "shm", "--page-sizes", "4K", "--pages", "10", "--repeats", "2",
                            "--stream", "3", "--no-fabtests", "--json", str(path)],
                           env=local_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"4096 B x +10 pages x 3 commands: .*0 wrong bytes", done.stdout), done.stdout
    assert "the median repeat (its last command)" in done.stdout, done.stdout
    (row,) = json.loads(path.read_text())["runs"]
    assert row["stream"] == 3 and row["wrong_bytes"] == 0
    assert round(row["mpps"] * 1e6 * row["elapsed_s"]) == 30  # pages moved in a repeat


@pytest.mark.long
def test_the_benchmark_writes_a_prepared_command_and_checks_its_pages(tmp_path):
    """--prepared: each case's command made once and written every repeat (by libfabric
    here: host memory); its pages checked as write_pages' are, and the record says so."""
    path = tmp_path / "bench.json"
    done = Budget(120).run([sys.executable, str(ROOT / "scripts" / "transfer_bench.py"), "-p",
                            "shm", "--page-sizes", "4K", "--pages", "10", "--repeats", "2",
                            "--prepared", "--no-fabtests", "--json", str(path)],
                           env=local_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"4096 B x +10 pages: .*0 wrong bytes", done.stdout), done.stdout
    (row,) = json.loads(path.read_text())["runs"]
    assert row["prepared"] is True and row["wrong_bytes"] == 0


@pytest.mark.parametrize("window, said", [("0", "must be positive"),
                                          ("1025", "more than the 64 MiB buffer")])
def test_a_window_the_buffer_cannot_hold_is_refused_in_one_line(window, said):
    done = Budget(60).run([sys.executable, str(ROOT / "scripts" / "transfer_bench.py"), "-p",
                           "shm", "--page-sizes", "4K,64K", "--window", window],
                          env=local_env(), cwd=ROOT)
    assert done.returncode == 2 and said in done.stderr, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr

"""The transfer engine's CUDA IPC route (common/transfer/ipc.py): GPU pages between two
processes of one host by a kernel, not a NIC. The GPU tests run two or three ranks on GPU 0
(tests/programs/transfer_ranks.py); the others check, without a GPU, what the route's C half does
with an inbox (the worker counts a finished command's immediates) and what an engine
without it says."""
import re

import numpy as np
import pytest

import common.fabric as fi
from common.transfer import Engine, ipc, wire
from common.transfer._native import ffi as _ffi, lib as native
from tests.support.budget import Budget
from tests.support.gpu import needs_gpu
from tests.support.transfer_launch import launched


def test_the_worker_counts_a_finished_command_from_its_inbox_and_not_before():
    """A writer's record counts once its seq is its number + 1 (what the kernel stores
    last), never before; the ring's `consumed` says the writer it may reuse the record."""
    with fi.Closer() as own:
        inbox = ipc.Inbox(own, _ffi, "0000:00:00.0")  # first: it closes after the worker
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        eng._w.inbox = inbox.box  # what Engine(gpu=N) does before its worker starts
        slot = native.tx_inbox_claim(inbox.box, 7)
        assert slot == 0 and native.tx_inbox_claim(inbox.box, 8) == 1
        records = native.tx_inbox_records(inbox.box, slot)
        for i, (imm, count) in enumerate([(42, 100), (43, 3), (42, 5)]):
            records[i].imm, records[i].count, records[i].has_imm = imm, count, 1
        records[1].seq = 2  # the second is done, the first not yet: nothing is counted
        with pytest.raises(TimeoutError):
            eng.expect(43, 3, 0.3)
        assert inbox.box.slot[slot].consumed == 0
        records[0].seq, records[2].seq = 1, 3
        eng.expect(42, 105, Budget(5).seconds)
        eng.expect(43, 3, Budget(5).seconds)
        assert inbox.box.slot[slot].consumed == 3


DEVICE = 1 << 62  # where FakeDriver's 'device' ring is: no host address


class FakeDriver:
    """ipc.Copier as copier.c drives it, with this process standing in for CUDA: an upload
    copies into a numpy 'device' ring, a launch runs ipc.cu's copies on the host (numpy
    buffers' addresses as src and dst) and, once `finish()` lets it, stores the kernel's
    marks as the GPU would. No GPU needed."""

    def __init__(self, entries, direct):
        self.ffi = _ffi
        self.host, self.device = np.zeros(entries, np.uint64), np.zeros(entries, np.uint64)
        self.finished = np.zeros(1, np.uint64)
        self.pending, self.kernels, self.uploads = [], [], 0
        self.upload = _ffi.callback("int(uint64_t, void *, size_t, void *)", self._upload,
                                    error=-1)  # a CUDA error: the copier says so
        self.launch = _ffi.callback("int(void *, unsigned, unsigned, unsigned, unsigned, "
                                    "unsigned, unsigned, unsigned, void *, void **, void **)",
                                    self._launch, error=-1)
        copier = self.copier = ipc.Copier.__new__(ipc.Copier)
        copier.ffi, copier.native = _ffi, native
        c = copier.c = _ffi.new("struct tx_copier *")
        c.launch, c.upload = (_ffi.cast("void *", f) for f in (self.launch, self.upload))
        c.host, c.device = _ffi.cast("uint64_t *", self.host.ctypes.data), DEVICE
        c.entries, c.direct, c.chunk, c.threads, c.max_blocks = entries, direct, 8192, 256, 64
        c.finished = _ffi.cast("uint64_t *", self.finished.ctypes.data)

    def _upload(self, dst, src, size, stream):
        at = (dst - DEVICE) // 8
        self.device[at:at + size // 8] = np.frombuffer(_ffi.buffer(src, size), np.uint64)
        self.uploads += 1
        return 0

    def _launch(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        word = lambda i: _ffi.cast("uint64_t *", params[i])[0]  # noqa: E731
        src, dst, table, scale, count, length = (word(i) for i in range(6))
        lengths = _ffi.cast("int *", params[6])[0]
        uploaded, n = table >= DEVICE, (3 if lengths else 2) * count
        entries = self.device[(table - DEVICE) // 8:][:n].copy() if uploaded else \
            np.frombuffer(_ffi.buffer(_ffi.cast("uint64_t *", table), 8 * n), np.uint64).copy()
        for i in range(count):
            n = int(entries[2 * count + i]) if lengths else length
            _ffi.memmove(_ffi.cast("char *", dst + int(entries[count + i]) * scale),
                         _ffi.cast("char *", src + int(entries[i]) * scale), n)
        self.kernels.append((count, not uploaded))
        self.pending.append((word(9), word(10), word(12)))  # seq_at, seq, its number
        return 0

    def finish(self, kernels=None):
        """Let the oldest `kernels` queued kernels (all: None) store their marks."""
        for seq_at, seq, number in self.pending[:kernels]:
            if seq_at:
                _ffi.cast("uint64_t *", seq_at)[0] = seq
            self.finished[0] = number
        del self.pending[:kernels]

    def send(self, src, src_pages, dst, dst_pages, page, mark, seq, wait=None, **kw):
        def never(ready, why):
            raise AssertionError(f"waited for {why()}")
        return self.copier.send(src.ctypes.data, np.asarray(src_pages, np.int64),
                                dst.ctypes.data, np.asarray(dst_pages, np.int64), page,
                                wait or never, (src.nbytes, dst.nbytes), page_size=page,
                                seq_at=mark.ctypes.data, seq=seq, **kw)


@pytest.mark.parametrize("direct", [0, 1 << 20], ids=["uploaded", "read-in-place"])
def test_the_copier_builds_each_table_and_launches_one_kernel(direct):
    """copier.c, with a fake driver: the table of a command's pages (checked, written in
    the ring, then times the page size in the kernel) moves exactly those pages, uploaded or read in
    place; the kernel stores the command's seq; bad items are refused before any launch."""
    fake = FakeDriver(4096, direct)
    rng = np.random.default_rng(7)
    page = 64
    src = rng.integers(0, 256, 50 * page, np.uint8)
    dst, mark = np.zeros(40 * page, np.uint8), np.zeros(1, np.uint64)
    src_pages, dst_pages = rng.permutation(50)[:30], rng.permutation(40)[:30]
    assert fake.send(src, src_pages, dst, dst_pages, page, mark, 5) is None
    fake.finish()
    want = np.zeros_like(dst)
    for s, d in zip(src_pages, dst_pages):
        want[d * page:(d + 1) * page] = src[s * page:(s + 1) * page]
    assert int((dst != want).sum()) == 0 and mark[0] == 5
    assert fake.kernels == [(30, direct > 0)] and fake.uploads == (0 if direct else 1)
    for pages, bad in [(([0, 50], [0, 1]), (0, 1)), (([0, 1], [39, 40]), (1, 1)),
                       (([-1], [0]), (0, 0))]:
        assert fake.send(src, *pages[:1], dst, *pages[1:], page, mark, 6) == bad
    for at in range(9):  # anywhere in the command: the first pass takes the largest only
        pages = [*range(at), 50, *range(at + 1, 9)]
        assert fake.send(src, pages, dst, range(9), page, mark, 6) == (0, at)
    assert len(fake.kernels) == 1 and mark[0] == 5
    lengths = np.array([3, 64, 17], np.uint64)  # byte offsets, each its own length
    assert fake.copier.send(src.ctypes.data, np.array([1, 100, 7]), dst.ctypes.data,
                            np.array([2000, 0, 500]), 0, None, (src.nbytes, dst.nbytes),
                            lengths=lengths, seq_at=mark.ctypes.data, seq=7) is None
    fake.finish()
    assert mark[0] == 7 and bytes(dst[2000:2003]) == bytes(src[1:4])
    assert bytes(dst[:64]) == bytes(src[100:164]) and bytes(dst[500:517]) == bytes(src[7:24])


def test_a_prepared_command_is_one_launch_of_its_own_table():
    """tx_copy_prepared: no pass over the items, no ring, no upload; the kernel reads the
    table where the command keeps it (byte offsets, scale 1) and stores the command's seq."""
    fake = FakeDriver(64, 0)
    src = np.arange(1000, dtype=np.uint8)
    dst, mark = np.zeros(1000, np.uint8), np.zeros(1, np.uint64)
    table = np.array([100, 0, 10, 600], np.uint64)  # sources, then destinations
    a = _ffi.new("struct tx_copy *")
    a.src, a.dst, a.count, a.scale, a.length = src.ctypes.data, dst.ctypes.data, 2, 1, 40
    a.table, a.longest = table.ctypes.data, 40
    a.seq_at, a.seq = _ffi.cast("uint64_t *", mark.ctypes.data), 9
    assert native.tx_copy_prepared(fake.copier.c, a) == 0
    assert mark[0] == 0  # the kernel has not run yet
    fake.finish()
    assert bytes(dst[10:50]) == bytes(src[100:140]) and bytes(dst[600:640]) == bytes(src[:40])
    assert mark[0] == 9 and fake.uploads == 0 and fake.copier.c.head == 0
    table = np.array([0, 500, 10, 300, 250, 20], np.uint64)  # ... then each one's length
    a.table, a.table_lengths, a.longest, a.seq = table.ctypes.data, 1, 250, 10
    dst[:] = 0
    assert native.tx_copy_prepared(fake.copier.c, a) == 0
    fake.finish()
    want = np.zeros_like(dst)
    want[10:260], want[300:320] = src[:250], src[500:520]
    assert int(np.count_nonzero(dst != want)) == 0 and mark[0] == 10
    assert fake.kernels == [(2, True), (2, True)]


def test_both_launch_paths_fill_the_command_s_record_in_the_peer_s_inbox_alike():
    """A prepared write (tx_write_prepared) and a per-call one (Route._record, then the
    copier) fill the record at `head` of the writer's ring with the command's immediate
    and count; only the kernel, after the bytes, stores its seq, head + 1."""
    fake = FakeDriver(64, 0)
    n = ipc.RECORDS  # a writer's ring: struct tx_inbox_record is seq, imm, count, has_imm
    records = np.zeros((n, 4), np.uint64)
    ring = _ffi.cast("struct tx_inbox_record *", records.ctypes.data)
    src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
    table = np.array([0, 64, 128, 0], np.uint64)
    a = _ffi.new("struct tx_copy *")
    a.count, a.scale, a.length, a.table, a.longest = 2, 1, 64, table.ctypes.data, 64
    head = n + 2  # once round the ring: record 2
    assert native.tx_write_prepared(fake.copier.c, a, ring, n - 1, head, 0xAB, 1,
                                    src.ctypes.data, dst.ctypes.data) == 0
    assert records[2].tolist() == [0, 0xAB, 2, 1]  # no seq before the kernel ran
    fake.finish()
    assert records[2, 0] == head + 1 and bytes(dst[128:192]) == bytes(src[:64])
    route = ipc.Route.__new__(ipc.Route)
    route.copier, route.records, route.head = fake.copier, ring, 2 * n - 1
    record, seq = route._record(None, 3)
    assert records[n - 1].tolist() == [0, 0, 3, 0] and seq == 2 * n
    assert int(_ffi.cast("uintptr_t", record)) == records[n - 1:].ctypes.data


def test_the_resident_kernel_takes_small_prepared_commands_from_its_queue():
    """tx_copy_prepared with a resident kernel (ipc.cu's ipc_stand), its side played here:
    a small command's job goes into the queue, the kernel launched only where it had left
    (from the first job it did not take, a new epoch); a big command, or one whose slot
    still holds a job not done, is launched as before (ipc_copy)."""
    fake = FakeDriver(64, 0)
    c = fake.copier.c
    stand = []  # ipc_stand's launches: (start, epoch, blocks)
    ipc_copy = fake.launch

    def launch(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        if f != c.stand:
            return ipc_copy(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
        stand.append((_ffi.cast("uint64_t *", params[2])[0],
                      _ffi.cast("uint64_t *", params[3])[0], gx))
        return 0
    callback = _ffi.callback("int(void *, unsigned, unsigned, unsigned, unsigned, unsigned, "
                             "unsigned, unsigned, void *, void **, void **)", launch, error=-1)
    queue = np.zeros(4 + ipc.STAND_SLOTS * ipc.STAND_JOB, np.uint64)
    queue[1] = ipc.STAND_STOPPED
    c.launch, c.stand = _ffi.cast("void *", callback), _ffi.cast("void *", 1)
    c.queue, c.stand_items, c.stand_blocks = _ffi.cast("uint64_t *", queue.ctypes.data), 8, 5
    marks = np.zeros(70, np.uint64)
    table = np.zeros(18, np.uint64)  # every copy: page 0 to page 0
    src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
    a = _ffi.new("struct tx_copy *")
    a.src, a.dst, a.count, a.scale = src.ctypes.data, dst.ctypes.data, 4, 4096
    a.length, a.longest, a.table = 4096, 4096, table.ctypes.data

    def write(seq):
        a.seq_at, a.seq = _ffi.cast("uint64_t *", marks.ctypes.data + 8 * seq), seq
        assert native.tx_copy_prepared(c, a) == 0

    write(1)  # stopped: launched, from job 0
    assert stand == [(0, 1, 5)] and queue[0] == 1 and queue[1] == ipc.STAND_RUNNING
    assert list(queue[4:4 + ipc.STAND_JOB]) == [src.ctypes.data, dst.ctypes.data,
                                                 table.ctypes.data, 4096, 4, 4096, 0, 1,
                                                 marks.ctypes.data + 8, 1]
    write(2)  # running: the job alone
    assert stand == [(0, 1, 5)] and queue[0] == 2
    queue[1], queue[2] = ipc.STAND_STOPPED, 2  # it took both, then left
    write(3)
    assert stand == [(0, 1, 5), (2, 2, 5)] and queue[0] == 3 and c.stand_jobs == 3
    for seq in range(4, 4 + ipc.STAND_SLOTS - 3):
        write(seq)
    assert queue[0] == ipc.STAND_SLOTS and not fake.kernels
    write(70)  # slot 0 again, and job 0 not done (its mark not stored): launched
    assert fake.kernels == [(4, True)] and queue[0] == ipc.STAND_SLOTS and dst.all()
    marks[1] = 1
    write(69)  # job 0 done: slot 0 is free
    assert queue[0] == ipc.STAND_SLOTS + 1 and queue[4 + ipc.STAND_JOB - 1] == 69
    a.count = 9  # 9 chunks: more than stand_items
    write(68)
    assert len(fake.kernels) == 2 and queue[0] == ipc.STAND_SLOTS + 1 and len(stand) == 2


def test_the_copier_reuses_a_table_s_entries_only_once_its_kernel_ran():
    """A ring of 16 entries: tables of 3 pages (6 entries) are taken in order, one that
    does not fit before the end starts again at 0, and the copier waits (the engine's
    wait) until the kernel that read a span has run before it writes there again."""
    fake = FakeDriver(16, 0)
    page = 8
    src, dst = np.arange(64 * page, dtype=np.uint8), np.zeros(64 * page, np.uint8)
    mark, starts, waits = np.zeros(1, np.uint64), [], []

    def wait(ready, why):
        assert not ready()
        waits.append(why())
        fake.finish(1)  # the oldest kernel runs: its span is free again
        assert ready()

    for seq in range(1, 6):
        assert fake.send(src, [seq, seq + 10, seq + 20], dst, [seq, seq + 10, seq + 20],
                         page, mark, seq, wait) is None
        starts.append(int(fake.copier.c.head) - 6)
    assert starts == [0, 6, 0, 6, 0]
    assert waits == ["room for a table of 6 entries in the staging ring"] * 3
    fake.finish()
    assert mark[0] == 5 and bytes(dst) == bytes(np.where(
        np.isin(np.arange(64 * page) // page, [s + k for s in range(1, 6) for k in (0, 10, 20)]),
        src, 0).astype(np.uint8))


def test_a_command_longer_than_half_the_ring_goes_as_several_kernels_checked_first():
    """A command of 20 pages through a ring of 16 entries: kernels of 4 pages (8 entries,
    half the ring), only the last storing the command's seq; a bad page at its end is
    refused before the first kernel."""
    fake = FakeDriver(16, 0)
    page = 8
    src = np.arange(40 * page, dtype=np.uint8)
    dst, mark = np.zeros(40 * page, np.uint8), np.zeros(1, np.uint64)
    assert fake.send(src, list(range(20)) + [40], dst, range(21), page, mark, 1) == (0, 20)
    assert fake.kernels == []

    def wait(ready, why):
        fake.finish(1)
    assert fake.send(src, range(20), dst, range(20, 40), page, mark, 1, wait) is None
    assert [k[0] for k in fake.kernels] == [4] * 5 and mark[0] == 0
    fake.finish()
    assert mark[0] == 1 and bytes(dst[20 * page:]) == bytes(src[:20 * page])


def test_a_host_engine_sends_by_libfabric_and_says_why():
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        peer = eng.connect(eng.address())
        assert (peer.route, peer.why) == ("libfabric", "host memory")
        assert eng.stats()["cuda_ipc_commands"] == 0


def test_a_region_descriptor_with_a_bad_handle_is_refused_in_one_line():
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=Budget(10).seconds)
        good = eng.register(np.zeros(64, np.uint8)).descriptor()
        bad = good + b"XXXX" + bytes(wire.HANDLE.size - 4)
        with pytest.raises(ValueError) as excinfo:
            eng.remote(bad)
        assert str(excinfo.value).startswith("not a region descriptor"), excinfo.value
        assert eng.remote(good + wire.pack_handle(bytes(64), 0, 1)).ipc \
            == (bytes(64), 0, 1)


@needs_gpu
@pytest.mark.parametrize("route", ["cuda-ipc", "libfabric"])
def test_gpu_pages_between_two_processes_arrive_by_either_route(route):
    """Rank 0 writes one unaligned WRITE and 256 pages in 6 commands into rank 1's GPU
    memory, immediates taken in another order; by CUDA IPC, or by shm (--no-cuda-ipc)."""
    done = launched(2, "pair", "-p", "shm", "--gpu", "0",
                    *(["--no-cuda-ipc"] if route == "libfabric" else []), timeout=30)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"[0] route to peer 0: {route}" in out, out
    assert "[1] single WRITE: wrong bytes: 0" in out, out
    assert "[1] paged WRITEs: 256 pages: wrong bytes: 0" in out, out
    ipc_commands = re.search(r"^\[0\] wrote 257 WRITEs; stats .*'cuda_ipc_commands': (\d+)",
                             out, re.M)
    assert ipc_commands and int(ipc_commands[1]) == (7 if route == "cuda-ipc" else 0), out


@needs_gpu
def test_gpu_a_scatter_and_barriers_of_three_ranks_by_cuda_ipc():
    """Each of 3 ranks scatters to all (itself too: its own memory, no handle to open) by
    CUDA IPC; the barriers' signals, in host memory, go by libfabric."""
    done = launched(3, "group", "-p", "shm", "--gpu", "0", "--length", "4099", timeout=30)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for r in range(3):
        assert f"[{r}] scatter of 4099 bytes from 3 ranks: wrong bytes: 0" in out, out
        assert re.search(rf"^\[{r}\] barriers: 3 passed; stats .*'cuda_ipc_commands': 3",
                         out, re.M), out
    assert out.count(": cuda-ipc (CUDA IPC, GPU 0 -> GPU 0)") == 9, out


@needs_gpu
@pytest.mark.parametrize("resident", [False, True], ids=["launched", "resident"])
@pytest.mark.parametrize("watch", [False, True], ids=["alone", "watching-the-group"])
def test_gpu_a_peer_killed_mid_transfer_by_cuda_ipc_is_seen(watch, resident):
    """Its memory stays mapped (a dead exporter's), so the survivor's kernels go on; its
    inbox takes no more commands: the survivor says so within its timeout, or at once
    when it watches the group. With resident=True, the survivor's commands went to the
    kernel that stays, and it left the GPU as the survivor closed."""
    done = launched(2, "kill", "-p", "shm", "--gpu", "0", *(["--watch"] * watch),
                    *(["--resident"] * resident), timeout=2, grace=60)
    assert done.returncode != 0
    taken = re.search(r"^\[0\] resident commands: (\d+)$", done.stdout, re.M)
    assert taken and (int(taken[1]) > 0) == resident, done.stdout + done.stderr
    assert "[1] got the first round; dying" in done.stdout, done.stdout + done.stderr
    assert "[0] route to peer 0: cuda-ipc" in done.stdout, done.stdout
    line = re.search(r"^\[0\] survivor: .*$", done.stdout, re.M)
    assert line, done.stdout + done.stderr
    if watch:  # the rendezvous says it when the connection closes or the launcher reaps it
        assert re.search(r"PeerGone: stopping: rank 1 (is gone|was killed by SIGKILL)",
                         line[0]), line[0]
    else:
        assert "took none of our last 1024 commands by CUDA IPC within 2 s" in line[0], line[0]
    assert "rank 1 was killed by SIGKILL" in done.stderr


@needs_gpu
def test_gpu_the_route_refuses_bad_items_in_one_line_and_cuts_a_long_command():
    """One engine writing to itself by CUDA IPC: out-of-range items give the libfabric
    route's lines (test_transfer_engine) with nothing launched; 140,000 pages, more than a
    kernel takes from the staging ring, go as two kernels and all arrive."""
    import cupy as cp
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", gpu=0, timeout=Budget(20).seconds)
        me = eng.connect(eng.address())
        assert me.route == "cuda-ipc", me.why
        n, page = 140_000, 64
        rng = np.random.default_rng(3)
        host = rng.integers(0, 256, n * page, np.uint8)
        src = eng.register(cp.asarray(host))
        out = cp.zeros(n * page, cp.uint8)
        dst = eng.remote(eng.register(out).descriptor())
        for call, pattern in [
            (lambda: eng.write_pages(me, src, [0, n], dst, [0, 1], page),
             f"source page {n} is out of range"),
            (lambda: eng.write_pages(me, src, [0, 1], dst, [n - 1, n], page),
             f"destination page {n} is out of range"),
            (lambda: eng.write_pages(me, src, [-1], dst, [0], page), "negative page"),
            (lambda: eng.write(me, src, 0, dst, 1, n * page), "destination bytes 1.."),
            (lambda: eng.write_list(me, src, [0], dst, [n * page - 2], [3]),
             f"destination bytes {n * page - 2}..{n * page + 1} are out"),
            (lambda: eng.write_pages(me, src, np.arange(n), dst, np.arange(1, n + 1), page),
             f"destination page {n} is out of range"),
        ]:
            with pytest.raises(ValueError) as excinfo:
                call()
            assert pattern in str(excinfo.value) and "\n" not in str(excinfo.value)
        copier = eng._routes.copier.c
        assert eng.stats()["cuda_ipc_commands"] == 0 and copier.launched == 0
        perm = rng.permutation(n)
        eng.write_pages(me, src, perm, dst, np.arange(n), page, imm=9)
        eng.expect(9, n, Budget(10).seconds)
        want = host.reshape(n, page)[perm].ravel()
        assert int((cp.asnumpy(out) != want).sum()) == 0
        assert copier.launched == 2


class Layers:
    """An engine writing to itself by CUDA IPC: `layers` x `pages` seeded pages of `page`
    bytes on the GPU, the array they land in, and one layer's prepared command (its pages
    in a seeded order), which write(imm0) sends shifted by a layer for each layer."""

    def __init__(self, eng, layers, pages, page, seed):
        import cupy as cp
        self.eng, self.layers, self.pages, self.page = eng, layers, pages, page
        self.me = eng.connect(eng.address())
        assert self.me.route == "cuda-ipc", self.me.why
        rng = np.random.default_rng(seed)
        self.host = rng.integers(0, 256, layers * pages * page, np.uint8)
        self.src = eng.register(cp.asarray(self.host))
        self.out = cp.zeros(layers * pages * page, cp.uint8)
        self.dst = eng.remote(eng.register(self.out).descriptor())
        self.order = rng.permutation(pages)
        self.prepared = eng.prepare_pages(self.me, self.src, np.arange(pages), self.dst,
                                          self.order, page)

    def write(self, imm0):
        for layer in range(self.layers):
            shift = layer * self.pages
            self.prepared.write(imm=imm0 + layer, src_shift=shift, dst_shift=shift)

    def check(self, imm0):
        """Each layer's immediates came, each byte where write_pages would put it."""
        import cupy as cp
        for layer in range(self.layers):
            self.eng.expect(imm0 + layer, self.pages, Budget(10).seconds)
        shape = (self.layers, self.pages, self.page)
        got = cp.asnumpy(self.out).reshape(shape)[:, self.order]
        assert int((got != self.host.reshape(shape)).sum()) == 0

    def check_list(self, imm):
        """A prepare_list of two copies with their own lengths, shifted by a byte and two."""
        import cupy as cp
        listed = self.eng.prepare_list(self.me, self.src, [0, 5000], self.dst, [3, 70000],
                                       [4099, 17])
        self.out[:] = 0
        listed.write(imm=imm, src_shift=1, dst_shift=2)
        self.eng.expect(imm, 2, Budget(10).seconds)
        want, host = np.zeros_like(self.host), self.host
        want[5:4104], want[70002:70019] = host[1:4100], host[5001:5018]
        assert int((cp.asnumpy(self.out) != want).sum()) == 0


@needs_gpu
def test_gpu_a_prepared_command_is_one_launch_a_write_and_lands_shifted():
    """prepare_pages and prepare_list by CUDA IPC, an engine writing to itself: each
    write() is one kernel (the table went to the GPU once), layer l shifted by l pages,
    every byte where write_pages would put it; a shift past the region is refused before
    any launch."""
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", gpu=0, timeout=Budget(20).seconds)
        t = Layers(eng, 6, 1000, 4096, seed=4)
        with pytest.raises(ValueError) as excinfo:
            t.prepared.write(imm=1, dst_shift=6 * 1000)
        assert "dst_shift 6000 puts bytes up to" in str(excinfo.value)
        copier = eng._routes.copier.c
        assert copier.launched == 0
        t.write(70)
        assert copier.launched == 6 and eng.stats()["cuda_ipc_commands"] == 6
        t.check(70)
        t.check_list(80)


@needs_gpu
def test_gpu_a_resident_copier_takes_small_prepared_commands_without_launches():
    """Engine(resident=True), writing to itself: 40 layers of 100 pages go to the kernel
    that stays (no ipc_copy launched), each byte where it belongs, a prepare_list with its
    lengths too; the kernel leaves after ipc.IDLE without a command and comes back for the
    next; a command of more chunks than it takes is launched as before; rest() sends it
    off the GPU at once."""
    import time

    import cupy as cp
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", gpu=0, timeout=Budget(20).seconds, resident=True)
        layers, pages = 40, 100
        t = Layers(eng, layers, pages, 4096, seed=5)
        copier = eng._routes.copier
        t.write(90)
        t.check(90)
        stats = eng.stats()
        assert stats["resident_commands"] == layers and copier.c.launched == 0, stats
        assert 1 <= stats["resident_launches"] <= layers, stats
        deadline = time.monotonic() + Budget(5).seconds
        while copier.queue[1] != ipc.STAND_STOPPED:  # it leaves by itself
            assert time.monotonic() < deadline, "the resident kernel never left"
            time.sleep(ipc.IDLE)
        t.check_list(140)
        assert eng.stats()["resident_launches"] == stats["resident_launches"] + 1
        big = layers * pages  # 4,000 chunks: more than the resident kernel takes
        assert big > copier.c.stand_items
        eng.prepare_pages(t.me, t.src, np.arange(big), t.dst, np.arange(big), 4096).write(
            imm=141)
        eng.expect(141, big, Budget(10).seconds)
        assert copier.c.launched == 1 and eng.stats()["resident_commands"] == layers + 1
        assert bool((t.out == cp.asarray(t.host)).all())
        eng.rest()
        assert copier.queue[1] == ipc.STAND_STOPPED

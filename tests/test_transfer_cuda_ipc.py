"""The transfer engine's CUDA IPC route (common/transfer/ipc.py): GPU pages between two
processes of one host by a kernel, not a NIC. The GPU tests run two or three ranks on GPU 0
(tests/transfer_ranks.py); the others check, without a GPU, what the route's C half does
with an inbox (the worker counts a finished command's immediates) and what an engine
without it says."""
import collections
import re

import numpy as np
import pytest

import common.fabric as fi
from common.transfer import Engine, ipc
from common.transfer import _ffi, native
from tests.budget import Budget
from tests.gpu import needs_gpu
from tests.transfer_launch import launched


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


def test_the_staging_ring_reuses_a_span_only_once_its_kernel_ran():
    """Copier's rings (no GPU needed for their bookkeeping): tables are taken in order
    around a ring of 16 entries, one that does not fit before the end starts again at 0,
    and a span is handed out again only after the kernel that read it is done."""
    ring = ipc.Copier.__new__(ipc.Copier)
    ring.host, ring.head, ring.spans = np.zeros(16, np.uint64), 0, collections.deque()
    done = [False] * 5

    def take(i, n):
        start = ring._room(n)
        if start is not None:
            ring.head = start + n
            ring.spans.append((start, lambda: done[i]))
        return start

    assert [take(0, 6), take(1, 6)] == [0, 6]
    assert take(2, 6) is None            # 4 left at the end, the start still in use
    done[0] = True
    assert take(2, 6) == 0               # the first kernel ran: its span again, from 0
    assert take(3, 1) is None            # full: [0, 6) and [6, 12), the end skipped
    done[1] = True
    assert take(3, 4) == 6 and take(4, 1) == 10
    done[2:5] = [True] * 3
    assert ring._room(16) == 0 and not ring.spans


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
        bad = good + b"XXXX" + bytes(ipc.HANDLE.size - 4)
        with pytest.raises(ValueError) as excinfo:
            eng.remote(bad)
        assert str(excinfo.value).startswith("not a region descriptor"), excinfo.value
        assert eng.remote(good + ipc.HANDLE.pack(ipc.MAGIC_HANDLE, bytes(64), 0, 1)).ipc \
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
@pytest.mark.parametrize("watch", [False, True], ids=["alone", "watching-the-group"])
def test_gpu_a_peer_killed_mid_transfer_by_cuda_ipc_is_seen(watch):
    """Its memory stays mapped (a dead exporter's), so the survivor's kernels go on; its
    inbox takes no more commands: the survivor says so within its timeout, or at once
    when it watches the group."""
    done = launched(2, "kill", "-p", "shm", "--gpu", "0", *(["--watch"] * watch), timeout=2,
                    grace=60)
    assert done.returncode != 0
    assert "[1] got the first round; dying" in done.stdout, done.stdout + done.stderr
    assert "[0] route to peer 0: cuda-ipc" in done.stdout, done.stdout
    line = re.search(r"^\[0\] survivor: .*$", done.stdout, re.M)
    assert line, done.stdout + done.stderr
    if watch:
        assert "PeerGone: stopping: rank 1 is gone" in line[0], line[0]
    else:
        assert "took none of our last 1024 commands by CUDA IPC within 2 s" in line[0], line[0]
    assert "rank 1 was killed by SIGKILL" in done.stderr

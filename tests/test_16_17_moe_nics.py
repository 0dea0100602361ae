"""The proxies of chapters 16 and 17 (common/moe/proxy.py) on several NICs: which NICs a
rank drives (its GPU's by chapter 08's topology, as common/engine/nics.py's rank_nics
chooses them, on the series' p5 rebuilt in a fake sysfs), which of them serves each peer,
the run on virtual NICs (shm, tcp) end to end; and the GPUDirect flush before a stamp:
when it is needed (faked device attributes) and the C side that calls it."""
import re
import sys
import threading
from collections import Counter

import pytest

import common.fabric as fi
from common import launch
from common.engine import topo
from common.engine.nics import rank_nics
from common.gpu import cuda_driver
from common.chapter_pair import ROOT, chapter_path, local_env
from tests.support import fake_info
from tests.programs import fake_sysfs
from tests.support.budget import Budget
from tests.support.gpu import needs_gpu
from tests.support.moe_runs import LAUNCH, LIMIT, SMALL, check_lines, gpus
from tests.support.one_line_errors import assert_one_line_error, run

CHAPTER = str(chapter_path(16))


@pytest.fixture(scope="module")
def moe():
    from common.moe import proxy
    return proxy


@pytest.fixture
def p5(tmp_path, monkeypatch):
    """The p5 as chapter 16 would find it: 8 GPUs, 32 EFA NICs, 4 behind each GPU's switch."""
    machine = fake_sysfs.p5(tmp_path)
    fake_sysfs.pretend(monkeypatch, tmp_path, machine)
    return fake_info.info_list([n["name"] for n in machine["nics"]])


def group(rank, world=16, per_node=8):
    return launch.Place(rank, world, per_node, None, None, False, "test")


def names(infos):
    return [fi.string(i.domain_attr.name) for i in infos]


def test_each_gpus_proxy_drives_that_gpus_nics(p5):
    for rank in range(16):  # two p5s: local rank = GPU
        gpu = rank % 8
        infos, line = rank_nics(p5, group(rank), gpu)
        first = fake_sysfs.P5_NIC_NAMES[gpu]
        assert names(infos) == [f"rdmap{first + k}s0" for k in range(4)]
        assert line == f"4 NICs (GPU {gpu}'s): " + " ".join(names(infos))
    infos, _ = rank_nics(p5, group(3), 3, count=2)
    assert names(infos) == ["rdmap130s0", "rdmap131s0"]
    with pytest.raises(ValueError, match="do not split evenly into 3"):
        rank_nics(p5, group(3), 3, count=3)


def test_a_rank_that_sees_only_its_gpu_drives_that_gpus_nics(p5, tmp_path, monkeypatch):
    """Slurm's --gpus-per-task, torchrun, CUDA_VISIBLE_DEVICES: rank r sees its GPU alone,
    as cuda:0; its proxy (16-17) and its transfer engine (18-19) drive that GPU's 4 NICs,
    as where it sees all 8, not all 32 NICs of the p5."""
    for rank in range(8):
        fake_sysfs.pretend(monkeypatch, tmp_path, fake_sysfs.p5(tmp_path, visible=[rank]))
        infos, line = rank_nics(p5, group(rank), 0)
        first = fake_sysfs.P5_NIC_NAMES[rank]
        assert names(infos) == [f"rdmap{first + k}s0" for k in range(4)]
        assert line == "4 NICs (GPU 0's): " + " ".join(names(infos))


def test_the_transfer_engines_worker_cores_with_one_visible_gpu(p5, tmp_path, monkeypatch):
    """common/transfer's worker thread runs on its GPU's slice of the cores (chapter 12),
    GPU 3's 36-47 on the p5, whether the process sees it as cuda:3 or alone as cuda:0."""
    from common.transfer import engine
    monkeypatch.setattr(topo.os, "sched_getaffinity", lambda pid: set(range(192)))
    assert engine.worker_cores(3) == set(range(36, 48))
    fake_sysfs.pretend(monkeypatch, tmp_path, fake_sysfs.p5(tmp_path, visible=[3]))
    assert engine.worker_cores(0) == set(range(36, 48))


@pytest.mark.parametrize("name", [  # the fast tier: the p5 and the p6-b300; the long one all
    name if name in ("p5", "p6_b300") else pytest.param(name, marks=pytest.mark.long)
    for name in fake_sysfs.EFA_SHAPES])
def test_each_efa_instances_ranks_drive_their_gpus_nics(tmp_path, monkeypatch, name):
    """The proxy (16-17) and the transfer engine (18-19) on a p5, p5en, p6-b200 and p6-b300:
    rank r drives GPU r's own 4 / 2 / 1 / 2 NICs, whether it sees the eight GPUs or its own
    alone, and its worker runs on that GPU's 12 cores."""
    from common.transfer import engine
    per_gpu, _ = fake_sysfs.EFA_SHAPES[name]
    make = fake_sysfs.INSTANCES[name]
    machine = make(tmp_path)
    head = fake_info.info_list([n["name"] for n in machine["nics"]])
    monkeypatch.setattr(topo.os, "sched_getaffinity", lambda pid: set(range(192)))
    for rank in range(8):
        want = [f"rdmap{int(machine['gpus'][rank].split(':')[1], 16) - per_gpu + k}s0"
                for k in range(per_gpu)]
        for visible, gpu in ((None, rank), ([rank], 0)):
            fake_sysfs.pretend(monkeypatch, tmp_path, make(tmp_path, visible))
            infos, line = rank_nics(head, group(rank), gpu)
            assert names(infos) == want
            assert line.startswith(f"{per_gpu} NIC{'s' * (per_gpu > 1)} (GPU {gpu}'s): ")
            assert engine.worker_cores(gpu) == set(range(12 * rank, 12 * rank + 12))


def test_a_nics_entry_of_another_fabric_is_not_taken(p5):
    """efa and efa-direct share domain names (prov/efa/src/efa_domain.h): a proxy's NICs
    come from the head's fabric and address format only."""
    for info in fi.each(p5):
        info.fabric_attr.prov_name = fi.lib.strdup(b"efa")  # freed with the list
    last = list(fi.each(p5))[-1]
    last.next = other = fi.lib.fi_allocinfo()  # freed with the list
    other.domain_attr.name = fi.lib.strdup(b"rdmap79s0")
    other.fabric_attr.name = fi.lib.strdup(b"efa-direct")
    other.fabric_attr.prov_name = fi.lib.strdup(b"efa")
    infos, _ = rank_nics(p5, group(0), 0)
    assert names(infos) == [f"rdmap{79 + k}s0" for k in range(4)]
    assert infos[0] == p5 and fi.string(infos[0].fabric_attr.name) == ""
    second = list(fi.each(p5))[1]
    second.fabric_attr.name = fi.lib.strdup(b"efa-direct")  # rdmap80s0: only efa-direct now
    with pytest.raises(ValueError, match="NIC rdmap80s0 is not in fabric"):
        rank_nics(p5, group(0), 0)


def test_host_memory_ranks_share_the_nodes_nics_in_order(p5):
    every = names(fi.each(p5))
    for local in range(8):
        infos, line = rank_nics(p5, group(local), None)
        assert names(infos) == every[4 * local:4 * local + 4]
        assert "a share of the node's" in line
    infos, _ = rank_nics(p5, launch.Place(5, 128, 64, None, None, False, "t"), None)
    assert names(infos) == [every[5 % 32]]  # fewer NICs than ranks: one each


def test_peers_are_sharded_over_a_ranks_nics_both_ways():
    """On two p5s every rank has 4 NICs and 8 peers on the other node: each NIC serves 2
    of its peers, a pair uses the same NIC index at both ends, and the 8 senders to one
    rank arrive spread over its 4 NICs too."""
    from common.moe import proxy as moe
    for rank in range(16):
        far = [r for r in range(16) if r // 8 != rank // 8]
        peers = {r: [(0, 1000 * r + k, b"nic%d" % k) for k in range(4)] for r in far}
        routes = moe.routes(rank, 4, peers, far)
        assert Counter(nic for nic, _ in routes.values()) == {0: 2, 1: 2, 2: 2, 3: 2}
        for r, (nic, (_, key, name)) in routes.items():
            assert (key, name) == (1000 * r + nic, b"nic%d" % nic)  # the peer's same index
            assert moe.routes(r, 4, {rank: [(0, 0, b"")] * 4}, [rank])[rank][0] == nic
    into_8 = Counter(moe.peer_nic(sender, 8, 4) for sender in range(8))
    assert into_8 == {0: 2, 1: 2, 2: 2, 3: 2}


def test_routes_with_fewer_nics_on_the_peer():
    from common.moe import proxy as moe
    routes = moe.routes(0, 4, {5: [(7, 70, b"only")]}, [5])
    assert routes == {5: (1, (7, 70, b"only"))}


def test_nic_lists_survive_the_allgather():
    from common.moe import proxy as moe
    nics = [(0x7F00, 17, b"fi_shm://1"), (0, 2**63, b"\x00\x01" * 40)]
    assert moe.unpack_nics(moe.pack_nics(nics)) == nics
    assert moe.unpack_nics(moe.pack_nics([])) == []


def test_virtual_nics_without_a_pci_address():
    head = fi.getinfo(fi.hints("shm", caps=fi.lib.FI_MSG | fi.lib.FI_RMA))
    infos, line = rank_nics(head, group(0), None)
    assert len(infos) == 1 and line == "1 virtual NIC, each a domain of shm (no NIC with a " \
                                       "PCI address here)"
    infos, line = rank_nics(head, group(0), None, count=3)
    assert len(infos) == 3 and line.startswith("3 virtual NICs")


@pytest.mark.long
@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_proxies_on_two_virtual_nics_each_pass_every_check(provider):
    """4 ranks as 2 emulated nodes, each proxy on 2 endpoints (virtual NICs): both far peers
    of a rank on different ones; every byte still checked against the reference."""
    command = [sys.executable, LAUNCH, "-n", "4", "--ranks-per-node", "2", CHAPTER,
               "-p", provider, *SMALL, "--nics", "2", "--check", "random,overflow,silent-rank",
               "--iters", "1"]
    done = Budget(LIMIT).run(command, env=local_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(check_lines(done.stdout)) == 6
    assert re.search(rf"^\[0\] provider: ({provider}\S*); proxy of rank 0: 2 virtual NICs, "
                     rf"each a domain of \1 ", done.stdout, re.MULTILINE), done.stdout
    assert re.search(r"^\[0\] all checks passed", done.stdout, re.MULTILINE)


@pytest.mark.long
def test_nics_out_of_range_is_one_line():
    done, _ = run(16, "--nics", "0")
    assert_one_line_error(done, "--nics must be 1..64, not 0")


# --- GPUDirect RDMA writes: flush before the stamp where the device asks for it -----------

def attributes(ordering, options):
    values = {cuda_driver.WRITES_ORDERING: ordering, cuda_driver.FLUSH_OPTIONS: options}
    return lambda which, gpu: values[which]


@pytest.mark.parametrize("provider,gpu,ordering,options,scope", [
    ("efa", 0, cuda_driver.NONE, cuda_driver.FLUSH_OPTION_HOST, cuda_driver.OWNER),
    ("verbs;ofi_rxm", 1, cuda_driver.NONE, 3, cuda_driver.OWNER),
    ("efa", 0, cuda_driver.OWNER, 0, None),         # the H200s: the owner reads in order
    ("efa", 0, cuda_driver.ALL_DEVICES, 0, None),
    ("efa", None, cuda_driver.NONE, 0, None),       # host memory: nothing of the GPU's
    ("shm", 0, cuda_driver.NONE, 0, None),          # shm copies: m16_settle waits for them
    ("tcp", 0, cuda_driver.NONE, 0, None),
])
def test_flush_only_where_a_nic_writes_and_the_device_does_not_order(provider, gpu, ordering,
                                                                     options, scope):
    assert cuda_driver.flush_scope(provider, gpu, attributes(ordering, options)) == scope


def test_a_device_that_neither_orders_nor_flushes_is_refused():
    with pytest.raises(ValueError, match="GPU 2 neither orders GPUDirect RDMA writes nor "
                                         "can flush them"):
        cuda_driver.flush_scope("efa", 2, attributes(cuda_driver.NONE, 2))  # MEMOPS only


def proxy_struct(moe, settle=None, flush=None):
    p = moe.ffi.new("struct m16_proxy *")
    keep = []
    if settle:
        keep.append(moe.ffi.callback("int (*)(void *)", settle))
        p.settle = keep[-1]
    if flush:
        keep.append(moe.ffi.callback("int (*)(int, int)", flush))
        p.flush = keep[-1]
    return p, keep


def test_settle_flushes_to_the_scope_after_the_shm_copies(moe):
    calls = []
    p, _keep = proxy_struct(moe, settle=lambda _: calls.append("settle") or 0,
                            flush=lambda target, scope: calls.append((target, scope)) or 0)
    p.flush_scope = cuda_driver.OWNER
    assert moe.native.m16_settle(p) == 0
    assert calls == ["settle", (cuda_driver.TARGET_CURRENT_CTX, cuda_driver.OWNER)]
    p, _keep = proxy_struct(moe)
    assert moe.native.m16_settle(p) == 0  # neither: nothing to do


def test_a_failed_flush_stops_the_stamp_and_says_so(moe, monkeypatch):
    p, _keep = proxy_struct(moe, flush=lambda target, scope: 999)
    assert moe.native.m16_settle(p) == 5 and p.settle_error == 999
    p.failed_call = 5
    monkeypatch.setattr(cuda_driver, "error_name", lambda rc: f"CUDA error {rc}")
    assert moe.settle_failure(p) == "the proxy's cuFlushGPUDirectRDMAWrites failed: " \
                                    "CUDA error 999"
    p, _keep = proxy_struct(moe, settle=lambda _: 4)
    assert moe.native.m16_settle(p) == 4
    p.failed_call = 4
    assert moe.settle_failure(p) == "the proxy's cudaStreamSynchronize failed (CUDA error 4)"


@needs_gpu
def test_gpu_the_flush_runs_from_a_thread_with_the_gpu_current(moe):
    """cuFlushGPUDirectRDMAWrites through m16_settle, as the proxy thread calls it: a no-op
    where the device orders the writes ("owner" on the H200s), but it must succeed."""
    from common.fabric import memory
    assert cuda_driver.attribute(cuda_driver.WRITES_ORDERING, 0) in cuda_driver.SCOPES
    p = moe.ffi.new("struct m16_proxy *")
    p.flush = moe.ffi.cast("int (*)(int, int)", cuda_driver.flush_address())
    p.flush_scope = cuda_driver.OWNER
    result = []

    def proxy_thread():
        memory.use_gpu(0)
        result.append((moe.native.m16_settle(p), p.settle_error))
    t = threading.Thread(target=proxy_thread)
    t.start()
    t.join()
    assert result == [(0, 0)]


@needs_gpu
@pytest.mark.parametrize("chapter,device", [(16, ["--device", "cuda"]), (17, [])],
                         ids=["16-host-driven", "17-gpu-driven"])
def test_gpu_proxies_on_two_virtual_nics_register_by_dmabuf(chapter, device):
    """GPU memory on 2 emulated nodes, each proxy on 2 shm domains: every check passes and
    each rank says how its region was registered (by dmabuf with libfabric >= 1.20)."""
    command = [sys.executable, LAUNCH, "-n", "2", "--ranks-per-node", "1", "--gpus", gpus(),
               str(chapter_path(chapter)), "-p", "shm", *device, *SMALL, "--nics", "2",
               "--check", "random,overflow", "--iters", "0"]
    done = Budget(LIMIT).run(command, env=local_env(), cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(check_lines(done.stdout)) == 4
    how = "by dmabuf" if fi.lib.tut_has_dmabuf() else "by address (no dmabuf: built against"
    for rank in (0, 1):
        assert f"[{rank}] GPU memory registered {how}" in done.stdout, done.stdout

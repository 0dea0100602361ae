"""Chapter 08 and common.engine.topo against fake machines: the series' p5, a one-GPU box,
NICs on the wrong NUMA node, no NUMA information at all, a ConnectX-7 box (verbs), and a
process that sees one GPU of eight (Slurm's --gpus-per-task, torchrun, CUDA_VISIBLE_DEVICES)."""
import functools
import shlex
import subprocess
import sys
import types

import pytest

from common.engine import topo
from common.engine.nics import lane_nics
import common.fabric as fi
from common.chapter_pair import ROOT, chapter_path, local_env
from tests.support import fake_info
from tests.programs import fake_sysfs
from tests.support.one_line_errors import assert_one_line_error, run

# The series' table (blog-series.md): GPU, bus, NUMA node, pinned core, its 4 NICs.
P5 = [(0, "53", 0, 6, 79), (1, "64", 0, 18, 96), (2, "75", 0, 30, 113), (3, "86", 0, 42, 130),
      (4, "97", 1, 54, 147), (5, "a8", 1, 66, 164), (6, "b9", 1, 78, 181), (7, "ca", 1, 90, 198)]

FAKE_SYSFS = str(ROOT / "tests" / "programs" / "fake_sysfs.py")


def chapter(sysfs, machine):
    done = subprocess.run([sys.executable, str(chapter_path(8)), "--sysfs", str(sysfs),
                           "--machine", str(machine)], capture_output=True, text=True,
                          env=local_env(), timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_08_prints_the_p5_table(tmp_path):
    assert_p5_table(chapter(tmp_path, fake_sysfs.save(tmp_path, fake_sysfs.p5(tmp_path))))


def test_08_on_the_p5_faked_in_a_folder_named_relative(tmp_path):
    """What tests/programs/fake_sysfs.py's docstring shows, in a folder of one's own: `fake_sysfs.py
    fake` there, then the command it prints, `--sysfs fake`. The tree's links point as
    sysfs's do, relative to the link's own folder: links to fake/devices/... from inside
    fake/bus/pci/devices/ led nowhere, and the NUMA column read "-"."""
    made = subprocess.run([sys.executable, FAKE_SYSFS, "fake"],
                          capture_output=True, text=True, env=local_env(), cwd=tmp_path,
                          timeout=30)
    assert made.returncode == 0, made.stderr
    command = shlex.split(made.stdout)
    assert command[command.index("--sysfs") + 1] == "fake", made.stdout
    done = subprocess.run(command, capture_output=True, text=True, env=local_env(),
                          cwd=tmp_path, timeout=30)
    assert done.returncode == 0, done.stderr
    assert_p5_table(done.stdout)


def assert_p5_table(out):
    assert "GPUs: 8 (described in" in out and "NICs: 32 (described)" in out
    assert "NUMA nodes: 2; physical cores: 96" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("cuda:")]
    assert len(rows) == 8
    for (gpu, bus, numa, core, nic), row in zip(P5, rows):
        nics = [f"rdmap{nic + k}s0" for k in range(4)]
        first = 12 * gpu
        assert row == [f"cuda:{gpu}", f"0000:{bus}:00.0", str(numa), f"{first}-{first + 11}",
                       str(core), *nics]
    assert "total link bandwidth: 32 NICs, 3200 Gbps" in out
    assert "note:" not in out


def test_08_one_gpu_box(tmp_path):
    machine = fake_sysfs.box(tmp_path, [(0, 0x00, [("nic", "mlx5_0", 0x11, 200),
                                                  ("gpu", None, 0x13, 0)])], nodes=[16])
    out = chapter(tmp_path, fake_sysfs.save(tmp_path, machine))
    assert out.splitlines()[-2].split() == ["cuda:0", "0000:13:00.0", "0", "0-15", "8", "mlx5_0"]
    assert "total link bandwidth: 1 NICs, 200 Gbps" in out


def test_08_nics_on_the_wrong_numa_node(tmp_path):
    # Both GPUs on NUMA 0, behind their own switches; both NICs elsewhere, on NUMA 1.
    machine = fake_sysfs.box(tmp_path, [(0, 0x00, [("gpu", None, 0x13, 0)]),
                                        (0, 0x00, [("gpu", None, 0x23, 0)]),
                                        (1, 0x80, [("nic", "efa_a", 0x91, 100),
                                                   ("nic", "efa_b", 0x92, 100)])],
                             nodes=[8, 8])
    out = chapter(tmp_path, fake_sysfs.save(tmp_path, machine))
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("cuda:")}
    assert rows["cuda:0"][-1] == "efa_a" and rows["cuda:1"][-1] == "efa_b"  # one each
    assert rows["cuda:0"][3:5] == ["0-3", "2"] and rows["cuda:1"][3:5] == ["4-7", "6"]
    assert "note: efa_a is on NUMA node 1, cuda:0 on 0" in out


def test_08_no_numa_information(tmp_path):
    machine = fake_sysfs.box(tmp_path, [(-1, 0x00, [("gpu", None, 0x13, 0),
                                                   ("nic", "n0", 0x11, 0)]),
                                        (-1, 0x00, [("gpu", None, 0x23, 0),
                                                   ("nic", "n1", 0x21, 0)])], nodes=None)
    out = chapter(tmp_path, fake_sysfs.save(tmp_path, machine))
    assert "NUMA nodes: 1; physical cores: 8" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("cuda:")]
    assert rows == [["cuda:0", "0000:13:00.0", "-", "0-3", "2", "n0"],
                    ["cuda:1", "0000:23:00.0", "-", "4-7", "6", "n1"]]
    assert "total link bandwidth: unknown" in out


def test_08_this_host_runs():
    done = subprocess.run([sys.executable, str(chapter_path(8))], capture_output=True, text=True,
                          env=local_env(), timeout=30)
    assert done.returncode == 0, done.stderr
    assert "physical cores:" in done.stdout


def test_08_bad_input(tmp_path):
    assert_one_line_error(run(8, "--sysfs", str(tmp_path / "nope"))[0], "no such directory")
    (tmp_path / "m.json").write_text("{not json")
    assert_one_line_error(run(8, "--machine", str(tmp_path / "m.json"))[0], "--machine")


def test_cpulist_and_ranges_round_trip():
    assert topo.cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert topo.ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert topo.ranges([]) == ""
    assert topo.pci_address("00000000:53:00.0") == topo.pci_address("0000:53:00.0") == "0000:53:00.0"


@pytest.mark.parametrize("per_gpu", [1, 2])
def test_08_connectx7_box_finds_verbs_nics_in_sysfs(tmp_path, per_gpu):
    """verbs gives no PCI address (verbs_info.c): the NICs are described without one,
    as fi_info lists them, and chapter 08 finds each in class/infiniband. Every GPU gets
    the NICs behind its own switch."""
    machine = fake_sysfs.cx7(tmp_path, per_gpu)
    assert all("bus" not in n for n in machine["nics"])
    out = chapter(tmp_path, fake_sysfs.save(tmp_path, machine))
    assert f"GPUs: 8 (described in" in out and f"NICs: {8 * per_gpu} (described)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("cuda:")]
    for g, row in enumerate(rows):
        assert row[:3] == [f"cuda:{g}", f"0000:{fake_sysfs.CX7_GPUS[g]:02x}:00.0", str(g // 4)]
        assert row[5:] == [f"mlx5_{g * per_gpu + k}" for k in range(per_gpu)]
    assert "total link bandwidth: %d NICs, 3200 Gbps" % (8 * per_gpu) in out
    assert "note:" not in out


def test_08_a_nic_neither_described_nor_in_sysfs_is_one_line(tmp_path):
    machine = fake_sysfs.cx7(tmp_path, 1)
    machine["nics"].append({"name": "mlx5_99", "gbps": 400})
    done = subprocess.run([sys.executable, str(chapter_path(8)), "--sysfs", str(tmp_path),
                           "--machine", str(fake_sysfs.save(tmp_path, machine))],
                          capture_output=True, text=True, env=local_env(), timeout=30)
    assert_one_line_error(done, "class/infiniband/mlx5_99")


def test_rdma_device_bus_follows_the_class_link(tmp_path):
    fake_sysfs.cx7(tmp_path, 2)
    assert topo.rdma_device_bus("mlx5_3", tmp_path) == "0000:29:00.0"  # GPU 1's second
    assert topo.rdma_device_bus("mlx5_16", tmp_path) is None
    assert topo.rdma_device_bus("", tmp_path) is None


@pytest.mark.parametrize("per_gpu", [1, 2])
def test_lanes_of_chapters_09_to_15_use_each_gpus_own_verbs_nics(tmp_path, monkeypatch,
                                                                 per_gpu):
    """The lanes' NICs (nics.lane_nics) on the ConnectX-7 box: GPU g's lanes are its own
    NICs, not every lane on one (what 09-15 did when verbs NICs had no PCI address)."""
    machine = fake_sysfs.cx7(tmp_path, per_gpu)
    fake_sysfs.pretend(monkeypatch, tmp_path, machine)
    head = fake_info.info_list([n["name"] for n in machine["nics"]])
    args = types.SimpleNamespace(gpus=list(range(8)), provider_used="verbs")
    for gpus, per in ((list(range(8)), None), ([6, 1], 1)):
        args.gpus = gpus
        infos, what = lane_nics(args, head, len(gpus), per)
        got = [[fi.string(i.domain_attr.name) for i in group] for group in infos]
        assert got == [[f"mlx5_{g * per_gpu + k}" for k in range(per or per_gpu)]
                       for g in gpus]
        assert what.startswith(f"{len(gpus)} x {per or per_gpu} NICs: mlx5_")


# --- one visible GPU per process ------------------------------------------------------------

def table(out):
    """{bus: the rest of its row but the name} and [(name, bus)] of chapter 08's table."""
    rows = [line.split() for line in out.splitlines() if line.startswith(("cuda:", "- "))]
    return {row[1]: row[2:] for row in rows}, [(row[0], row[1]) for row in rows]


@pytest.mark.parametrize("visible", [[3], [6, 1]])
def test_08_a_process_that_sees_some_gpus_gets_the_table_of_all_eight(tmp_path, visible):
    """Under Slurm's --gpus-per-task or torchrun a process sees its GPU alone: the table
    is still the machine's (sysfs's GPUs), each GPU with its own 4 NICs and cores, and the
    GPUs this process sees are named as CUDA numbers them; the others read '-'."""
    everything = chapter(tmp_path, fake_sysfs.save(tmp_path, fake_sysfs.p5(tmp_path)))
    out = chapter(tmp_path, fake_sysfs.save(tmp_path, fake_sysfs.p5(tmp_path, visible)))
    assert table(out)[0] == table(everything)[0]
    names = {bus: name for name, bus in table(out)[1]}
    assert names == {f"0000:{bus:02x}:00.0": f"cuda:{visible.index(g)}" if g in visible else "-"
                     for g, bus in enumerate(fake_sysfs.P5_GPUS)}
    assert f"GPUs: 8, {len(visible)} of them seen by this process (described in" in out
    assert "total link bandwidth: 32 NICs, 3200 Gbps" in out


def test_08_a_visible_gpu_past_the_described_ones_is_one_line(tmp_path):
    machine = fake_sysfs.p5(tmp_path, visible=[8])
    done = subprocess.run([sys.executable, str(chapter_path(8)), "--sysfs", str(tmp_path),
                           "--machine", str(fake_sysfs.save(tmp_path, machine))],
                          capture_output=True, text=True, env=local_env(), timeout=30)
    assert_one_line_error(done, '"visible" [8]: not indexes into "gpus" (0..7)')


def test_the_gpus_on_the_bus_are_nvidias_display_and_3d_controllers(tmp_path):
    """The fake p5 has NVSwitches (NVIDIA's, class 0x0680) and the BMC's VGA controller
    (ASPEED's, class 0x0300) on its bus beside the GPUs and NICs: only the 8 GPUs count."""
    machine = fake_sysfs.p5(tmp_path)
    assert topo.physical_gpus(tmp_path) == machine["gpus"]
    assert topo.physical_gpus(tmp_path / "nothing") == []


def p5_nics(machine):
    return [topo.Nic(n["name"], n["bus"], n["gbps"]) for n in machine["nics"]]


@pytest.mark.parametrize("gpu", range(8))
def test_layout_of_one_visible_gpu_is_its_row_of_the_eight(tmp_path, gpu):
    """topo.layout with the one GPU CUDA sees: its own 4 NICs and its slice of the cores,
    as with all 8 seen; not all 32 NICs and the whole NUMA node on the one GPU."""
    machine = fake_sysfs.p5(tmp_path)
    (mine,) = topo.layout([machine["gpus"][gpu]], p5_nics(machine), tmp_path)
    eight = topo.layout(machine["gpus"], p5_nics(machine), tmp_path)[gpu]
    first = fake_sysfs.P5_NIC_NAMES[gpu]
    assert [n.name for n in mine.nics] == [f"rdmap{first + k}s0" for k in range(4)]
    assert (mine.index, mine.bus, mine.numa, mine.cores, mine.core) == \
        (0, eight.bus, eight.numa, eight.cores, eight.core) == \
        (0, machine["gpus"][gpu], gpu // 4, list(range(12 * gpu, 12 * gpu + 12)), P5[gpu][3])


def test_the_visible_gpus_keep_cudas_order(tmp_path):
    machine = fake_sysfs.p5(tmp_path)
    seen = [machine["gpus"][6], machine["gpus"][1]]  # CUDA_VISIBLE_DEVICES=6,1
    gpus = topo.layout(seen, p5_nics(machine), tmp_path)
    assert [(g.index, g.bus, g.nics[0].name) for g in gpus] == \
        [(0, seen[0], "rdmap181s0"), (1, seen[1], "rdmap96s0")]


@pytest.mark.parametrize("machine_of", [fake_sysfs.p5, functools.partial(fake_sysfs.cx7,
                                                                         per_gpu=2)],
                         ids=["p5", "cx7"])
def test_lanes_of_chapters_09_to_15_with_one_visible_gpu_use_its_own_nics(tmp_path,
                                                                         monkeypatch,
                                                                         machine_of):
    """nics.lane_nics for `--gpus 0` in a process that sees GPU 5 alone: GPU 5's NICs,
    the same as `--gpus 5` where it sees all 8."""
    lanes = {}
    for visible, gpus in ((None, [5]), ([5], [0])):
        machine = machine_of(tmp_path, visible=visible)
        fake_sysfs.pretend(monkeypatch, tmp_path, machine)
        head = fake_info.info_list([n["name"] for n in machine["nics"]])
        args = types.SimpleNamespace(gpus=gpus, provider_used="efa")
        infos, what = lane_nics(args, head, 1, None)
        lanes[visible is None] = [fi.string(i.domain_attr.name) for i in infos[0]]
    assert lanes[False] == lanes[True] and len(lanes[True]) in (2, 4)


def test_chapter_12s_worker_core_with_one_visible_gpu_is_the_one_of_eight(tmp_path,
                                                                           monkeypatch):
    """topo.worker_cores pins GPU 3's worker to core 42 whether the process sees all 8
    GPUs or GPU 3 alone (as cuda:0), not to the middle of its whole NUMA node."""
    machine = fake_sysfs.p5(tmp_path)
    monkeypatch.setattr(topo.os, "sched_getaffinity", lambda pid: set(range(192)))
    monkeypatch.setattr(topo, "gpus_here", lambda: (machine["gpus"], None))
    assert topo.worker_cores([3], 1, tmp_path) == [42]
    monkeypatch.setattr(topo, "gpus_here", lambda: ([machine["gpus"][3]], None))
    assert topo.worker_cores([0], 1, tmp_path) == [42]


def test_a_gpu_without_a_nic_of_its_own_shares_its_numa_nodes(tmp_path, monkeypatch):
    """Fewer NICs than GPUs (a g5.48xlarge: 8 GPUs, 1 EFA NIC): the GPU behind no NIC's
    switch drives those of its NUMA node, else any, as the one that owns them does; not a
    ZeroDivisionError, whether the process sees both GPUs or that one alone."""
    two = [(0, 0x00, [("nic", "efa0", 0x11, 100), ("gpu", None, 0x13, 0)]),
           (1, 0x80, [("gpu", None, 0x93, 0)])]
    head = fake_info.info_list(["efa0"])
    for visible, gpu in ((None, 1), ([1], 0)):
        fake_sysfs.pretend(monkeypatch, tmp_path, fake_sysfs.box(tmp_path, two, [4, 4], visible))
        infos, what = lane_nics(types.SimpleNamespace(gpus=[gpu], provider_used="efa"), head,
                                1, None)
        assert [fi.string(i.domain_attr.name) for i in infos[0]] == ["efa0"]
        assert what == "1 x 1 NICs: efa0"


# --- the EFA instances of 2026: p5, p5en, p6-b200, p6-b300 ----------------------------------

EFA = list(fake_sysfs.EFA_SHAPES)
# the fast tier lays out the p5 and the p6-b300 (4 NICs a GPU at 100 Gbps, 2 at 400)
TIERED = [name if name in ("p5", "p6_b300") else pytest.param(name, marks=pytest.mark.long)
          for name in EFA]


def own_nics(machine, gpu):
    """The NICs behind GPU `gpu`'s switch in a fake EFA instance: efa names each by its bus."""
    bus = int(machine["gpus"][gpu].split(":")[1], 16)
    return [n["name"] for n in machine["nics"]
            if bus - len(machine["nics"]) // 8 <= int(n["bus"].split(":")[1], 16) < bus]


@pytest.mark.parametrize("name", EFA)
def test_08_on_each_efa_instance_faked_by_name(tmp_path, name):
    """`tests/programs/fake_sysfs.py DIR NAME`, then the command it prints: chapter 08 shows each
    GPU with its own 4 / 2 / 1 / 2 NICs and 3200 / 3200 / 3200 / 6400 Gbps in total."""
    per_gpu, total = fake_sysfs.EFA_SHAPES[name]
    made = subprocess.run([sys.executable, FAKE_SYSFS, "fake", name],
                          capture_output=True, text=True, env=local_env(), cwd=tmp_path,
                          timeout=30)
    assert made.returncode == 0, made.stderr
    done = subprocess.run(shlex.split(made.stdout), capture_output=True, text=True,
                          env=local_env(), cwd=tmp_path, timeout=30)
    assert done.returncode == 0, done.stderr
    machine = fake_sysfs.INSTANCES[name](tmp_path / "again")
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("cuda:")]
    assert [row[5:] for row in rows] == [own_nics(machine, g) for g in range(8)]
    assert all(len(row[5:]) == per_gpu for row in rows)
    assert f"total link bandwidth: {8 * per_gpu} NICs, {total} Gbps" in done.stdout
    assert "note:" not in done.stdout


def test_fake_sysfs_names_an_unknown_instance_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, FAKE_SYSFS, "fake", "p4d"],
                          capture_output=True, text=True, env=local_env(), cwd=tmp_path,
                          timeout=30)
    assert_one_line_error(done, "usage: .venv/bin/python tests/programs/fake_sysfs.py DIR "
                                "[p5|p5en|p6_b200|p6_b300|cx7]")


@pytest.mark.parametrize("name", TIERED)
def test_08_each_efa_instance_with_one_visible_gpu_keeps_its_nics(tmp_path, name):
    """A process given GPU g alone sees the table of the eight, GPU g as cuda:0 with the
    same NICs as where it sees all."""
    make = fake_sysfs.INSTANCES[name]
    everything = table(chapter(tmp_path, fake_sysfs.save(tmp_path, make(tmp_path))))[0]
    for g in (0, 5):
        out = chapter(tmp_path, fake_sysfs.save(tmp_path, make(tmp_path, visible=[g])))
        assert table(out)[0] == everything
        (mine,) = [line.split() for line in out.splitlines() if line.startswith("cuda:0")]
        assert mine[1] == make(tmp_path)["gpus"][g]


@pytest.mark.parametrize("name", TIERED)
def test_lanes_of_chapters_09_to_15_on_each_efa_instance(tmp_path, monkeypatch, name):
    """nics.lane_nics: each GPU's lanes are its own NICs (4 / 2 / 1 / 2), all eight seen or
    only the one given; `--nics-per-gpu 1` takes the first of them."""
    per_gpu, _ = fake_sysfs.EFA_SHAPES[name]
    machine = fake_sysfs.INSTANCES[name](tmp_path)
    head = fake_info.info_list([n["name"] for n in machine["nics"]])
    fake_sysfs.pretend(monkeypatch, tmp_path, machine)
    for per in (None, 1):
        infos, what = lane_nics(types.SimpleNamespace(gpus=list(range(8)), provider_used="efa"),
                                head, 8, per)
        assert [[fi.string(i.domain_attr.name) for i in group] for group in infos] == \
            [own_nics(machine, g)[:per] for g in range(8)]
        assert what.startswith(f"8 x {per or per_gpu} NICs: ")
    for g in range(8):
        fake_sysfs.pretend(monkeypatch, tmp_path, fake_sysfs.INSTANCES[name](tmp_path, [g]))
        infos, _ = lane_nics(types.SimpleNamespace(gpus=[0], provider_used="efa"), head, 1, None)
        assert [fi.string(i.domain_attr.name) for i in infos[0]] == own_nics(machine, g)

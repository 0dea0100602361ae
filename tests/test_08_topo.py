"""Chapter 08 and common.engine.topo against fake machines: the series' p5, a one-GPU box,
NICs on the wrong NUMA node, no NUMA information at all, a ConnectX-7 box (verbs)."""
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
from tests import fake_info, fake_sysfs
from tests.one_line_errors import assert_one_line_error, run

# The series' table (blog-series.md): GPU, bus, NUMA node, pinned core, its 4 NICs.
P5 = [(0, "53", 0, 6, 79), (1, "64", 0, 18, 96), (2, "75", 0, 30, 113), (3, "86", 0, 42, 130),
      (4, "97", 1, 54, 147), (5, "a8", 1, 66, 164), (6, "b9", 1, 78, 181), (7, "ca", 1, 90, 198)]


def chapter(sysfs, machine):
    done = subprocess.run([sys.executable, str(chapter_path(8)), "--sysfs", str(sysfs),
                           "--machine", str(machine)], capture_output=True, text=True,
                          env=local_env(), timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_08_prints_the_p5_table(tmp_path):
    assert_p5_table(chapter(tmp_path, fake_sysfs.save(tmp_path, fake_sysfs.p5(tmp_path))))


def test_08_on_the_p5_faked_in_a_folder_named_relative(tmp_path):
    """What tests/fake_sysfs.py's docstring shows, in a folder of one's own: `fake_sysfs.py
    fake` there, then the command it prints, `--sysfs fake`. The tree's links point as
    sysfs's do, relative to the link's own folder: links to fake/devices/... from inside
    fake/bus/pci/devices/ led nowhere, and the NUMA column read "-"."""
    made = subprocess.run([sys.executable, str(ROOT / "tests" / "fake_sysfs.py"), "fake"],
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

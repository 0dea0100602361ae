"""scripts/doctor.py: here as it is, and on fake machines (a p5's PCI bus in a fake sysfs,
/proc/meminfo, /dev) where each layer of an RDMA NIC or a GPU is missing in turn."""
import importlib.util
import re
import resource
import shutil
import subprocess
import sys

import pytest

import common.fabric as fi
from common.engine import topo
from common.gpu import cuda_driver
from scripts import doctor
from scripts.doctor import ABSENT, FIX, OK, Machine
from common.chapter_pair import ROOT, local_env
from tests.support import fake_info
from tests.programs import fake_sysfs
from tests.support.gpu import needs_gpu

LINE = re.compile(r"^(ok  |--  |FIX ) \S.{13} \S")


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "doctor.py"), *args],
                          capture_output=True, text=True, env=local_env(), timeout=60)


def p5(tmp_path):
    """The series' p5 on the PCI bus (EFA NICs and NVIDIA GPUs with their ids), nothing
    else: no RDMA device in the kernel, no huge pages, no /dev/gdrdrv. (sysfs, machine)"""
    sysfs = tmp_path / "sys"
    machine = fake_sysfs.p5(sysfs)
    (tmp_path / "dev").mkdir()
    return sysfs, machine


def lines_of(out):
    """{topic: (status, text)} of the doctor's output, every line checked for its shape."""
    *lines, verdict = out.strip().splitlines()
    assert all(LINE.match(line) for line in lines), out
    return {line[5:19].strip(): (line[:4].strip(), line[20:]) for line in lines}, verdict


def test_here_every_line_has_a_status_and_the_exit_code_counts_the_fixes():
    done = run()
    assert "Traceback" not in done.stderr and done.stderr == ""
    lines, verdict = lines_of(done.stdout)
    fixes = [topic for topic, (status, _) in lines.items() if status == FIX]
    assert done.returncode == (1 if fixes else 0), done.stdout
    assert lines["libfabric"][1].startswith("%d.%d loaded from /" % fi.version())
    if not topo.gpus_here()[0] and not any(Machine().nics_on_bus(p) for p in doctor.REAL_NICS):
        assert lines["GPU"][0] == ABSENT and lines["efa"][0] == lines["verbs"][0] == ABSENT
        assert verdict.startswith("no RDMA NIC and no GPU here")


def test_efa_nics_on_the_bus_without_the_driver_are_a_fix(tmp_path):
    sysfs, _ = p5(tmp_path)
    done = run("--sysfs", str(sysfs), "--dev", str(tmp_path / "dev"))
    lines, verdict = lines_of(done.stdout)
    assert lines["efa"] == (FIX, "32 EFA NICs on the PCI bus, but the kernel has no RDMA device "
                            "for them: install the EFA driver: the AWS EFA installer")
    assert lines["verbs"][0] == ABSENT
    if not topo.gpus_here()[0]:
        assert lines["GPU"][0] == FIX and "8 NVIDIA GPUs on the PCI bus" in lines["GPU"][1]
    assert done.returncode == 1 and "to fix (FIX)" in verdict


def test_rdma_devices_libfabric_cannot_open_are_a_fix(tmp_path, monkeypatch):
    fake_info.pretend(monkeypatch, absent=("efa",))
    sysfs, machine = p5(tmp_path)
    for k, nic in enumerate(machine["nics"][:2]):
        device = sysfs / "class" / "infiniband" / f"rdmap{k}" / "device"
        device.parent.mkdir(parents=True)
        device.symlink_to(sysfs / "bus" / "pci" / "devices" / nic["bus"])
    line, info = doctor.nic_lines(fi, Machine(sysfs), "efa")
    assert info is None and line[0] == FIX
    assert line[2].startswith("32 EFA NICs on the PCI bus (rdmap0, rdmap1), but ")
    if "efa" in fi.providers():  # built in, no device: the process cannot reach it
        assert "libfabric opens none of them: the process needs /dev/infiniband/uverbs*" in line[2]
    else:  # Debian's libfabric
        assert "this libfabric has no efa provider: LIBFABRIC_PREFIX=/opt/amazon/efa" in line[2]


def efa_info(fabric, caps):
    info = fi.hints("efa", caps=caps)
    info.fabric_attr.name = fi.lib.strdup(fabric.encode())  # freed by fi_freeinfo
    return info


def test_rdma_write_is_read_from_efa_direct(monkeypatch):
    monkeypatch.delenv("FI_EFA_USE_DEVICE_RDMA", raising=False)
    rma = fi.lib.FI_MSG | fi.lib.FI_RMA
    assert doctor.rdma_write_line(fi, efa_info("efa-direct", rma))[0] == OK
    line = doctor.rdma_write_line(fi, efa_info("efa-direct", fi.lib.FI_MSG))
    assert line[0] == ABSENT and "efa's RDM fabric emulates WRITEs" in line[2]
    assert doctor.rdma_write_line(fi, efa_info("efa", rma))[0] == ABSENT  # libfabric 1.x
    monkeypatch.setenv("FI_EFA_USE_DEVICE_RDMA", "0")
    assert doctor.rdma_write_line(fi, efa_info("efa-direct", rma))[0] == FIX


def test_locked_memory_matters_only_with_a_real_nic():
    small = 8 << 20
    line = doctor.memlock_line(real_nic=True, limit=small, caps=0)
    assert line[0] == FIX and "ulimit -l is 8192 KiB" in line[2] and "--ulimit memlock=-1" in line[2]
    assert doctor.memlock_line(real_nic=False, limit=small, caps=0)[0] == ABSENT
    assert doctor.memlock_line(real_nic=True, limit=small, caps=1 << doctor.CAP_IPC_LOCK)[0] == OK
    assert doctor.memlock_line(real_nic=True, limit=resource.RLIM_INFINITY, caps=0)[0] == OK


def test_huge_pages_and_gdrcopy_from_fake_proc_and_dev(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nHugePages_Total: 512\n"
                                      "HugePages_Free: 500\nHugepagesize: 2048 kB\n")
    (tmp_path / "gdrdrv").touch()
    machine = Machine(tmp_path, proc=tmp_path, dev=tmp_path)
    assert doctor.hugepage_line(machine) == (OK, "huge pages", "500 free of 2048 kB: efa's "
                                             "internal buffers use them")
    assert doctor.hugepage_line(Machine(tmp_path, proc=tmp_path / "none"))[0] == ABSENT
    if not doctor.ctypes.util.find_library("gdrapi"):
        line = doctor.gdrcopy_line(machine, buses=["0000:53:00.0"])
        assert line[0] == ABSENT and line[2].startswith("no libgdrapi: install gdrcopy")


@pytest.mark.parametrize("dmabuf,peermem,real_nic,status", [
    (1, False, True, OK), (0, True, True, OK), (0, False, True, FIX), (0, False, False, ABSENT)])
def test_a_nic_reaches_gpu_memory_by_dmabuf_or_peermem(tmp_path, monkeypatch, dmabuf, peermem,
                                                        real_nic, status):
    if peermem:
        (tmp_path / "module" / "nvidia_peermem").mkdir(parents=True)
    attributes = {cuda_driver.DMA_BUF_SUPPORTED: dmabuf,
                  cuda_driver.WRITES_ORDERING: 100}
    monkeypatch.setattr(doctor, "cuda_attribute", attributes.get)
    line = doctor.nic_to_gpu_line(fi, Machine(tmp_path), real_nic)
    assert line[0] == (status if dmabuf == 0 or fi.version() >= (1, 20) else FIX)
    assert f"nvidia_peermem {'loaded' if peermem else 'not loaded'}" in line[2]
    assert "ordered for the GPU (owner)" in line[2]


def test_the_gpu_nic_map_is_chapter_08s(tmp_path):
    machine = fake_sysfs.p5(tmp_path)
    nics = [topo.Nic(n["name"], n["bus"], n["gbps"]) for n in machine["nics"]]
    line = doctor.topology_line(Machine(tmp_path), machine["gpus"], nics)
    assert line == (OK, "GPU-NIC map", "8 GPUs, 32 NICs: 4 NICs per GPU, each on its GPU's "
                    "NUMA node (chapters/08_topo.py prints the table)")
    assert doctor.topology_line(Machine(tmp_path), [], nics)[0] == ABSENT
    line = doctor.topology_line(Machine(tmp_path), machine["gpus"][5:6], nics)
    assert line == (OK, "GPU-NIC map", "8 GPUs (1 seen by this process), 32 NICs: 4 NICs per "
                    "GPU, each on its GPU's NUMA node; cuda:0 (0000:a8:00.0) drives rdmap164s0 "
                    "rdmap165s0 rdmap166s0 rdmap167s0, as with all seen (chapters/08_topo.py "
                    "prints the table)")


def test_the_systems_libfabric_beside_the_efa_installers_is_a_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "EFA_INSTALLER", tmp_path)
    line, _ = doctor.libfabric(Machine())
    if doctor.loaded_from().startswith(("/usr/", "/lib")):
        assert line[0] == FIX and line[2].endswith(f"not the EFA installer's in {tmp_path}: "
                                                   "bash scripts/setup.sh (uses it by default)")
    else:  # one set up on purpose (LIBFABRIC_PREFIX)
        assert line[0] == OK


def test_a_missing_directory_is_one_line():
    done = run("--sysfs", "/nonexistent")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "doctor.py: error: --sysfs /nonexistent: no such directory\n"



def test_with_a_gpu_each_provider_registers_gpu_memory_or_says_why(tmp_path, monkeypatch):
    fake_info.pretend(monkeypatch, absent=("efa", "verbs"))
    monkeypatch.setattr(topo, "gpus_here", lambda: (["0000:53:00.0"], None))
    lines, _ = doctor.examine(Machine(tmp_path, proc=tmp_path, dev=tmp_path))
    memory = [line for line in lines if line[1] == "GPU memory"]
    assert len(memory) == 1 and memory[0][2].startswith("shm")  # no efa/verbs device here
    if importlib.util.find_spec("cupy") is None:
        assert memory[0] == (FIX, "GPU memory", "shm: GPU memory needs cupy (pip install "
                             "cupy-cuda12x or cupy-cuda13x)")
    assert [line[1] for line in lines].count("NIC to GPU") == 1


@needs_gpu
def test_on_a_gpu_machine_shm_registers_gpu_memory():
    lines = run().stdout.splitlines()
    assert any(re.match(r"ok +GPU +\d+ CUDA devices", line) for line in lines)
    assert any(re.fullmatch(r"ok   GPU memory     shm registers GPU 0 memory \(FI_HMEM\): by "
                            r"(dmabuf|address \(no dmabuf: .*\))", line) for line in lines), lines


def test_the_binding_built_against_a_newer_libfabric_than_the_one_loaded_is_a_fix():
    loaded = fi.version()
    assert doctor.binding_line(fi, "/x/lib/libfabric.so.1", loaded) == (
        OK, "binding", "built against libfabric %d.%d, %d.%d loaded" % (loaded * 2))
    assert doctor.binding_line(fi, "/x/lib/libfabric.so.1", (1, 0))[0] == OK  # older: fine
    line = doctor.binding_line(fi, "/x/lib/libfabric.so.1", (loaded[0] + 1, 0))
    assert line[0] == FIX and line[2].startswith(
        "built against libfabric %d.0, %d.%d loaded: an older libfabric refuses the binding's "
        "API version (fi_getinfo: -FI_ENOSYS); build it against the one loaded "
        "(LIBFABRIC_PREFIX=/x bash scripts/setup.sh)" % (loaded[0] + 1, *loaded))


MAPS = """\
7f0000000000-7f0000001000 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libfabric.so.1.20.0
7f0000001000-7f0000002000 r-xp 00001000 08:01 1 /usr/lib/x86_64-linux-gnu/libfabric.so.1.20.0
7f0000002000-7f0000003000 rw-p 00000000 00:00 0
7f0000003000-7f0000004000 r--p 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libfabric-extra.so
7f0000004000-7f0000005000 r--p 00000000 08:01 3 /opt/amazon/ofi-nccl/lib/libnccl-net.so
"""
EFA_LIB = "7f0000006000-7f0000007000 r-xp 00000000 08:01 4 /opt/amazon/efa/lib/libfabric.so.1\n"
WHEELS = "7f0000008000-7f0000009000 r-xp 00000000 08:01 5 /w/nixl.libs/libfabric-0a1b2c3d.so.1\n"


def test_a_second_libfabric_in_the_process_is_a_fix_naming_both():
    ours = "/usr/lib/x86_64-linux-gnu/libfabric.so.1.20.0"
    assert doctor.libfabrics(MAPS) == [ours]
    line = doctor.libfabric_copies_line(ours, doctor.libfabrics(MAPS), [])
    assert line == (OK, "one libfabric", f"{ours} alone in this process, nothing else here "
                    "loads one (no torch, no NCCL net plugin)")
    assert doctor.libfabrics(MAPS + WHEELS)[1] == "/w/nixl.libs/libfabric-0a1b2c3d.so.1"
    mapped = doctor.libfabrics(MAPS + EFA_LIB)
    assert mapped == [ours, "/opt/amazon/efa/lib/libfabric.so.1"]
    line = doctor.libfabric_copies_line(ours, mapped, ["torch", "libnccl-net.so"])
    assert line == (FIX, "one libfabric", f"2 in this process, with torch, libnccl-net.so "
                    f"loaded: {ours} (the binding's) and /opt/amazon/efa/lib/libfabric.so.1: "
                    "efa can answer fi_getinfo with an empty list, or NCCL fall back to TCP; "
                    "use one: LIBFABRIC_PREFIX=/opt/amazon/efa bash scripts/setup.sh, and "
                    "LD_LIBRARY_PATH=/opt/amazon/efa/lib")


def test_here_the_process_has_one_libfabric_with_what_an_engine_loads():
    lines, _ = lines_of(run().stdout)
    assert lines["one libfabric"] == (OK, lines["one libfabric"][1])
    assert lines["one libfabric"][1].startswith(doctor.loaded_from() + " alone in this process")


def with_plugin(tmp_path, code):
    """The doctor run with NCCL_NET_PLUGIN, as NCCL takes it: a library whose loading does
    `code` (C, in its constructor)."""
    (tmp_path / "plugin.c").write_text("#include <dlfcn.h>\n#include <signal.h>\n"
                                       "__attribute__((constructor)) static void load(void) "
                                       f"{{ {code}; }}\n")
    plugin = tmp_path / "libnccl-net-test.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", plugin, tmp_path / "plugin.c", "-ldl"],
                   check=True, timeout=60)
    return plugin, subprocess.run([sys.executable, str(ROOT / "scripts" / "doctor.py")],
                                  capture_output=True, text=True, timeout=60,
                                  env={**local_env(), "NCCL_NET_PLUGIN": str(plugin)})


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_a_net_plugin_that_loads_its_own_libfabric_is_found_in_the_process(tmp_path):
    """A second libfabric: a copy, opened by its path (as a RUNPATH's or a bundled one)."""
    copy = tmp_path / "lib" / "libfabric.so.1"
    copy.parent.mkdir()
    shutil.copy(doctor.loaded_from(), copy)
    plugin, done = with_plugin(tmp_path, f'dlopen("{copy}", RTLD_NOW | RTLD_LOCAL)')
    lines, _ = lines_of(done.stdout)
    assert lines["one libfabric"][0] == FIX and done.returncode == 1
    assert re.match(rf"2 in this process, with (torch, )?{re.escape(str(plugin))} loaded: "
                    rf"{re.escape(doctor.loaded_from())} \(the binding's\) and "
                    rf"{re.escape(str(copy))}: ", lines["one libfabric"][1]), \
        lines["one libfabric"][1]  # torch: where it is importable, the doctor loads it too


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C while the doctor loads what an engine would: the plugin sends it itself."""
    _, done = with_plugin(tmp_path, "raise(SIGINT)")
    assert done.returncode == 130 and done.stderr == "doctor.py: interrupted\n"


@pytest.mark.parametrize("current,status", [(lambda: True, OK), (lambda: False, FIX)])
def test_registering_gpu_memory_by_dmabuf_needs_a_current_cuda_context(monkeypatch, current,
                                                                       status):
    monkeypatch.setattr(doctor, "dmabuf_here", lambda fi: True)
    line = doctor.dmabuf_context_line(fi, current)
    assert line[:2] == (status, "dmabuf context")
    if status == FIX:
        assert "(CUDA_ERROR_INVALID_CONTEXT)" in line[2]
        assert line[2].endswith("make the GPU's primary context current on that thread first "
                                "(cudaSetDevice(gpu), or cuDevicePrimaryCtxRetain and "
                                "cuCtxSetCurrent)")


def test_without_dmabuf_the_cuda_context_is_not_asked(monkeypatch):
    monkeypatch.setattr(doctor, "cuda_attribute", {cuda_driver.DMA_BUF_SUPPORTED: 0}.get)
    assert doctor.dmabuf_context_line(fi, lambda: pytest.fail("asked")) is None


def fake_getinfo(entries):
    """fi.getinfo over fake_info entries, filtered as libfabric 2.1's core filters them by
    provider, fabric name (src/fabric.c) and caps."""
    def getinfo(hint, flags=0):
        provider, fabric = fi.string(hint.fabric_attr.prov_name), fi.string(hint.fabric_attr.name)
        chosen = [e for e in entries if provider in ("", e.provider)
                  and fabric in ("", e.fabric) and hint.caps & ~e.caps == 0]
        if not chosen:
            raise fi.FabricError("fi_getinfo", -fi.lib.FI_ENODATA)
        return fake_info.infos(*chosen)
    return getinfo


def fabric_text(lines, chapters):
    return next(text for _, topic, text in lines if text.startswith(chapters + " ("))


def test_each_chapter_is_told_the_fabric_its_hints_pick(monkeypatch):
    rdm, direct = (fake_info.Entry("rdmap79s0-rdm", fabric=name, pci="0000:4f:00.0")
                   for name in ("efa", "efa-direct"))
    fake_info.patch(monkeypatch, "getinfo", fake_getinfo([direct, rdm]))  # libfabric 2.x's order
    lines = doctor.fabric_lines(fi)
    assert [line[:2] for line in lines] == [(OK, "fabric")] * 3
    assert fabric_text(lines, "chapters 06-07, 09-19") == (
        "chapters 06-07, 09-19 (FI_MSG, FI_RMA): efa (default), fabric efa, domain "
        "rdmap79s0-rdm; efa lists efa-direct, efa for these hints, the chapters take efa, "
        "and efa-direct with -p efa-direct (common/fabric FABRICS)")
    fake_info.patch(monkeypatch, "getinfo", fake_getinfo([rdm]))  # libfabric 1.x: efa alone
    assert fabric_text(doctor.fabric_lines(fi), "chapter 08") == (
        "chapter 08 (FI_RMA): efa (default), fabric efa, domain rdmap79s0-rdm")
    no_rma = fake_info.Entry("shm", fabric="shm", provider="shm", caps=fi.lib.FI_MSG)
    fake_info.patch(monkeypatch, "getinfo", fake_getinfo([no_rma]))
    lines = {text.split(" (")[0]: status for status, _, text in doctor.fabric_lines(fi)}
    assert lines == {"chapters 04-05": OK, "chapters 06-07, 09-19": FIX, "chapter 08": FIX}


# --- the EFA instances of 2026, one visible GPU, GPUDirect, the libfabric loaded ---------------

def nics_of(machine, sysfs):
    return [topo.Nic(n["name"], n.get("bus") or topo.rdma_device_bus(n["name"], sysfs), n["gbps"])
            for n in machine["nics"]]


@pytest.mark.parametrize("name,text", [
    ("p5", "p5.48xlarge: 32 EFA NICs of 100 Gbps, 3200 Gbps"),
    ("p5en", "p5en.48xlarge: 16 EFA NICs of 200 Gbps, 3200 Gbps"),
    ("p6_b200", "p6-b200.48xlarge: 8 EFA NICs of 400 Gbps, 3200 Gbps"),
    ("p6_b300", "p6-b300.48xlarge: 16 EFA NICs of 400 Gbps, 6400 Gbps"),
    ("cx7", "a ConnectX host (verbs): 8 NICs of 400 Gbps, 3200 Gbps")])
def test_the_instance_is_told_by_its_nics_and_their_speeds(tmp_path, name, text):
    """From the NICs libfabric lists and their link speeds; the ConnectX box has a p6-b200's
    shape (8 x 400 Gbps): only efa's NICs name an instance."""
    machine = fake_sysfs.INSTANCES[name](tmp_path)
    line = doctor.instance_line(nics_of(machine, tmp_path), "verbs" if name == "cx7" else "efa")
    assert line == (OK, "instance", text)


def test_efa_nics_of_no_known_instance_are_described(tmp_path):
    nics = [topo.Nic(f"rdmap{k}s0", f"0000:{k + 16:02x}:00.0", 300) for k in range(4)]
    assert doctor.instance_line(nics) == (
        ABSENT, "instance", "not an EFA instance this project knows (p5, p5en, p6-b200, "
        "p6-b300): 4 NICs of 300 Gbps, 1200 Gbps")


def test_an_instance_short_of_nics_is_said(tmp_path):
    """31 of a p5's 32 NICs listed, or 12 of a p6-b300's 16: a NIC the driver or libfabric
    lost, or another instance (a p4d has 4 of 100 Gbps): said, with where to look."""
    nics = nics_of(fake_sysfs.p5(tmp_path), tmp_path)
    line = doctor.instance_line(nics[:31])
    assert line == (ABSENT, "instance", "31 EFA NICs of 100 Gbps, 3100 Gbps: a p5.48xlarge has "
                    "32; if this is one, libfabric lists fewer: fi_info -p efa, and the EFA "
                    "driver (ls /sys/class/infiniband)")
    nics = nics_of(fake_sysfs.p6_b300(tmp_path / "b300"), tmp_path / "b300")
    assert doctor.instance_line(nics[:12])[2].startswith("12 EFA NICs of 400 Gbps, 4800 Gbps: "
                                                         "a p6-b300.48xlarge has 16;")
    assert doctor.instance_line([])[0] == ABSENT
    assert doctor.instance_line([topo.Nic("x", "0000:01:00.0", 0)])[0] == ABSENT


@pytest.mark.parametrize("name", ["p5", "p5en", "p6_b200", "p6_b300", "cx7"])
def test_the_nic_plan_of_a_process_that_sees_one_gpu(tmp_path, name):
    """Slurm, torchrun, CUDA_VISIBLE_DEVICES: the doctor names the NICs that GPU drives, the
    same as chapter 08's row for it with all eight seen."""
    machine = fake_sysfs.INSTANCES[name](tmp_path)
    nics = nics_of(machine, tmp_path)
    eight = topo.layout(machine["gpus"], nics_of(machine, tmp_path), tmp_path)
    line = doctor.topology_line(Machine(tmp_path), machine["gpus"][3:4], nics)
    per = len(nics) // 8
    assert line == (OK, "GPU-NIC map", f"8 GPUs (1 seen by this process), {len(nics)} NICs: "
                    f"{per} NIC{'s' * (per > 1)} per GPU, each on its GPU's NUMA node; cuda:0 "
                    f"({machine['gpus'][3]}) drives {' '.join(n.name for n in eight[3].nics)}, "
                    "as with all seen (chapters/08_topo.py prints the table)")


def test_efa_without_gpudirect_is_a_fix_not_a_registration(monkeypatch):
    """efa registers GPU memory its device cannot reach with a made-up key and copies through
    host memory (rdm/efa_rdm_mr.c efa_rdm_mr_reg_impl): the doctor opens the endpoint as the
    chapters do (fi.open_endpoint requires GPUDirect first) and says what is missing."""
    efa = fake_info.efa_over_shm(monkeypatch, fi.lib.FI_MSG | fi.lib.FI_RMA | fi.lib.FI_HMEM)
    monkeypatch.setattr(doctor, "offered", lambda fi, provider, caps=None: efa)
    (line,) = doctor.gpu_memory_lines(fi, ["efa"])
    assert line[:2] == (FIX, "GPU memory")
    assert line[2].startswith("efa: the EFA device cannot reach GPU memory (GPUDirect RDMA): "
                              "it needs nvidia-peermem loaded"), line
    assert "through host memory" in line[2] and "\n" not in line[2]


V = fi.lib  # the rules' modes

@pytest.mark.parametrize("version,more,counters,wait", [
    ((1, 17), ABSENT, ABSENT, ABSENT), ((2, 1), ABSENT, ABSENT, ABSENT),
    ((2, 3), ABSENT, ABSENT, ABSENT), ((2, 5), ABSENT, ABSENT, OK),
    ((2, 6), ABSENT, ABSENT, OK), ((2, 7), OK, OK, OK)])
def test_what_the_libfabric_loaded_changes_on_efa(version, more, counters, wait):
    lines = {topic: (status, text) for status, topic, text in doctor.version_lines(fi, version)}
    assert set(lines) == {"FI_MORE", "HW counters", "CQ wait"}
    assert [lines[t][0] for t in ("FI_MORE", "HW counters", "CQ wait")] == [more, counters, wait]
    v = "%d.%d" % version
    if more == ABSENT:
        assert lines["FI_MORE"][1].startswith(f"efa's fabric on libfabric {v} may send a WRITE "
                                              "it queued with FI_MORE and ring no doorbell:")
        assert "-p efa-direct" in lines["FI_MORE"][1] and "2.7" in lines["FI_MORE"][1]
    else:
        assert lines["FI_MORE"][1].startswith(f"libfabric {v}: efa's fabric rings the doorbell")
    assert ("FI_EFA_USE_HW_CNTR" in lines["HW counters"][1]
            and "a CQ must still be read" in lines["HW counters"][1])
    direct, efa = version >= (2, 3), version >= (2, 5)
    assert lines["CQ wait"][1].startswith(
        f"libfabric {v}: blocking CQ reads (FI_WAIT_UNSPEC, FI_WAIT_FD) on "
        + ("efa and efa-direct" if efa else "efa-direct only" if direct else "neither fabric"))


@pytest.mark.parametrize("chapter,direct_rma,version,fabric", [
    (5, True, (2, 6), "efa"), (7, True, (2, 6), "efa-direct"), (7, False, (2, 6), "efa"),
    (14, True, (2, 6), "efa-direct"), (14, True, (2, 7), "efa-direct"),
    (16, True, (2, 6), "efa-direct"), (19, True, (2, 6), "efa-direct"), (3, True, (2, 6), "either")])
def test_efa_or_efa_direct_for_the_chapter_asked(chapter, direct_rma, version, fabric):
    rma = fi.lib.FI_MSG | (fi.lib.FI_RMA if direct_rma else 0)
    status, topic, text = doctor.chapter_line(fi, chapter, efa_info("efa-direct", rma), version)
    assert (status, topic) == (OK, f"chapter {chapter:02d}")
    assert text.startswith(f"{fabric}" + (f" (-p {fabric})" if fabric != "either" else "")), text
    if not direct_rma:
        assert "efa-direct has no FI_RMA here" in text
    if chapter == 14:
        assert ("FI_MORE off on efa's fabric" in text) == (version < (2, 7))


def test_a_chapter_without_efa_here_says_so():
    assert doctor.chapter_line(fi, 14, None, (2, 6))[0] == ABSENT


def test_a_chapter_out_of_range_is_one_line():
    done = run("--chapter", "21")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "doctor.py: error: --chapter 21: the chapters are 03-19\n"


def test_the_doctor_on_a_p6_b300_rank_that_sees_gpu_3(tmp_path, monkeypatch):
    """examine() on the fake p6-b300 with its 16 NICs listed by efa (both fabrics), in a
    process given GPU 3 alone, asked about chapter 14: the instance, the NIC plan of that
    GPU, what the libfabric loaded changes, and the fabric for 14, each one line."""
    machine = fake_sysfs.p6_b300(tmp_path)
    entries = [fake_info.Entry(f"{n['name']}-rdm", fabric=fabric, pci=n["bus"], gbps=n["gbps"])
               for fabric in ("efa-direct", "efa") for n in machine["nics"]]
    monkeypatch.setattr(doctor, "offered", lambda fi, provider, caps=None: (
        fake_info.infos(*entries) if provider == "efa" and not (caps or 0) & fi.lib.FI_HMEM
        else None))
    monkeypatch.setattr(topo, "gpus_here", lambda: ([machine["gpus"][3]], None))
    monkeypatch.delenv("FI_EFA_USE_DEVICE_RDMA", raising=False)
    lines, _ = doctor.examine(Machine(tmp_path, proc=tmp_path, dev=tmp_path), chapter=14)
    said = {topic: (status, text) for status, topic, text in lines}
    assert said["instance"] == (OK, "p6-b300.48xlarge: 16 EFA NICs of 400 Gbps, 6400 Gbps")
    assert "cuda:0 (0000:86:00.0) drives rdmap132s0-rdm rdmap133s0-rdm, as with all seen" \
        in said["GPU-NIC map"][1]
    assert {"FI_MORE", "HW counters", "CQ wait"} <= set(said)
    assert said["chapter 14"][1].startswith("efa-direct (-p efa-direct): one doorbell a batch")
    assert said["GPU memory"][0] == FIX  # no FI_HMEM granted by the fake

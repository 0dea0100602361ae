"""The machine's layout: which NICs and which CPU cores belong to which GPU (chapter 08).

Read from sysfs (the PCIe tree, NUMA nodes, hyperthread siblings, the machine's
GPUs), the PCI addresses of the GPUs this process sees from CUDA and the NICs'
from libfabric (efa), or from sysfs for the RDMA device libfabric names
(verbs). A NIC belongs to the GPU it shares the deepest PCIe bridge with (on a
p5: the switch in front of each GPU and its 4 NICs); a NIC that shares none
with any GPU goes to the GPU of its NUMA node that has the fewest NICs so far.
Each NUMA node's physical cores are split evenly among its GPUs; the middle
core of a GPU's slice is the one its thread will be pinned to. Which of them
each user drives is chosen from this layout in nics.py.

The layout is of every GPU on the PCI bus, not only of those CUDA shows: under
Slurm's --gpus-per-task, torchrun or CUDA_VISIBLE_DEVICES a process sees one
GPU, and laid out alone it would take every NIC of the machine and every core
of its NUMA node.
The GPUs it sees are found in it by their PCI addresses, so each gets the NICs
and cores it would get were all of them seen.

Everything takes a `sysfs` root so the tests can hand in a fake tree.
"""
import os
from dataclasses import dataclass, field
from pathlib import Path

SYSFS = Path("/sys")


@dataclass
class Nic:
    name: str          # libfabric's domain name, e.g. rdmap79s0
    bus: str           # PCI address, e.g. 0000:4f:00.0
    gbps: float = 0.0  # link speed, 0 when unknown
    numa: int = None


@dataclass
class Gpu:
    index: int         # CUDA's number for it in this process; None for one it does not see
    bus: str
    numa: int = None
    cores: list = field(default_factory=list)  # its slice of its NUMA node's physical cores
    core: int = None                            # the one to pin its thread to
    nics: list = field(default_factory=list)

    def name(self):
        """cuda:N, or the PCI address of a GPU this process does not see."""
        return self.bus if self.index is None else f"cuda:{self.index}"


def cpulist(text):
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]"""
    cpus = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def _read(path, default=None):
    try:
        return Path(path).read_text().strip()
    except OSError:
        return default


NVIDIA = "0x10de"
# PCI classes of a GPU: a 3D controller (the data-center GPUs) or a VGA controller. An
# NVSwitch is NVIDIA's too, but a bridge (0x0680); a BMC's display is VGA, but not NVIDIA's.
GPU_CLASSES = ("0x0302", "0x0300")


def pci_devices(sysfs=SYSFS, vendor=None, device=None, classes=("",)):
    """PCI addresses, in order, of the devices of `vendor` whose device id starts with
    `device` and class with one of `classes` (sysfs's vendor, device and class files)."""
    found = []
    for d in sorted((Path(sysfs) / "bus" / "pci" / "devices").glob("*")):
        ids = [_read(d / name, "") for name in ("vendor", "device", "class")]
        if ids[0] == vendor and ids[1].startswith(device or "") and ids[2].startswith(classes):
            found.append(d.name)
    return found


def physical_gpus(sysfs=SYSFS):
    """PCI addresses of the machine's NVIDIA GPUs, whichever of them CUDA shows."""
    return pci_devices(sysfs, NVIDIA, classes=GPU_CLASSES)


def pci_path(bus, sysfs=SYSFS):
    """The chain of PCI addresses from the root port down to `bus`, e.g.
    ['0000:00:01.0', '0000:4e:00.0', '0000:4f:00.0'], or [bus] when sysfs does not know it."""
    link = Path(sysfs) / "bus" / "pci" / "devices" / bus.lower()
    if not link.exists():
        return [bus.lower()]
    return [part for part in os.path.realpath(link).split(os.sep) if part.count(":") == 2]


def numa_node(bus, sysfs=SYSFS):
    value = _read(Path(sysfs) / "bus" / "pci" / "devices" / bus.lower() / "numa_node")
    return int(value) if value is not None and int(value) >= 0 else None


def physical_cores(sysfs=SYSFS):
    """{NUMA node: [cores]}, one hyperthread per core (the first of its siblings).
    Without NUMA information, every online CPU is in node 0."""
    system = Path(sysfs) / "devices" / "system"
    nodes = {int(p.name[4:]): cpulist(_read(p / "cpulist", ""))
             for p in (system / "node").glob("node[0-9]*")} if (system / "node").is_dir() else {}
    if not nodes:
        nodes = {0: cpulist(_read(system / "cpu" / "online", "") or "0")}
    cores = {}
    for node, cpus in sorted(nodes.items()):
        keep = []
        for cpu in cpus:
            siblings = cpulist(_read(system / "cpu" / f"cpu{cpu}" / "topology" /
                                     "thread_siblings_list", str(cpu)))
            if min(siblings) == cpu or min(siblings) not in cpus:
                keep.append(cpu)
        cores[node] = keep
    return cores


def shared_depth(a, b):
    """How many bridges two PCI paths share below the root complex."""
    depth = 0
    for x, y in zip(a[:-1], b[:-1]):
        if x != y:
            break
        depth += 1
    return depth


def machine_layout(gpu_buses, nics, sysfs=SYSFS):
    """[Gpu] for every GPU of the machine, in PCI order, with their NICs and cores; those
    CUDA sees carry its number. `gpu_buses`: the PCI address of each GPU CUDA sees, in its
    order (a GPU sysfs does not list, as in a container that hides it, is laid out too);
    `nics`: [Nic] as libfabric lists them."""
    seen = [pci_address(bus) for bus in gpu_buses]
    buses = sorted(set(physical_gpus(sysfs)) | set(seen))
    gpus = [Gpu(seen.index(bus) if bus in seen else None, bus, numa_node(bus, sysfs))
            for bus in buses]
    paths = [pci_path(g.bus, sysfs) for g in gpus]
    for nic in nics:
        nic.numa = numa_node(nic.bus, sysfs)
        if not gpus:
            continue
        path = pci_path(nic.bus, sysfs)
        depth = [shared_depth(p, path) for p in paths]
        best = max(range(len(gpus)), key=depth.__getitem__)
        if depth[best] <= 1:
            # only the root port (or nothing) in common: fall back to the NUMA node
            near = [k for k, g in enumerate(gpus) if g.numa == nic.numa] or range(len(gpus))
            best = min(near, key=lambda k: (len(gpus[k].nics), k))
        gpus[best].nics.append(nic)
    cores = physical_cores(sysfs)
    for node, cpus in cores.items():
        mine = [g for g in gpus if (g.numa if g.numa is not None else 0) == node]
        if len(cores) == 1:
            mine = gpus  # one node (or none known): every GPU shares it
        for k, gpu in enumerate(mine):
            share = len(cpus) // len(mine)
            gpu.cores = cpus[k * share:(k + 1) * share] if share else cpus[:]
            gpu.core = gpu.cores[len(gpu.cores) // 2] if gpu.cores else None
    return gpus


def layout(gpu_buses, nics, sysfs=SYSFS):
    """[Gpu] of the GPUs CUDA sees, indexed by CUDA's number, each with the NICs and cores
    it has in the machine's layout (machine_layout)."""
    gpus = [g for g in machine_layout(gpu_buses, nics, sysfs) if g.index is not None]
    return sorted(gpus, key=lambda g: g.index)


def gpus_here():
    """(PCI addresses of this host's GPUs in CUDA order, None) or ([], why there are none)."""
    try:
        import cupy as cp
        count = cp.cuda.runtime.getDeviceCount()
    except ImportError:
        return [], "no cupy, so no CUDA"
    except Exception as e:  # CUDARuntimeError: no driver, no device
        return [], f"CUDA found none ({str(e).split(':')[0]})"
    if not count:
        return [], "CUDA found none"
    return [pci_address(cp.cuda.runtime.deviceGetPCIBusId(i)) for i in range(count)], None


def pci_address(text):
    """'00000000:53:00.0' (nvidia-smi) or '0000:53:00.0' (CUDA, sysfs) -> '0000:53:00.0'"""
    domain, bus, rest = text.strip().lower().split(":")
    return f"{int(domain, 16):04x}:{bus}:{rest}"


def nics_here(head, sysfs=SYSFS):
    """[Nic] for each domain of an fi_info list that has a PCI address (real NICs)."""
    from common.fabric import each, ffi, lib, string
    nics, seen = [], set()
    bus = ffi.new("char[16]")
    for info in each(head):
        name = string(info.domain_attr.name)
        if name in seen:
            continue
        if lib.tut_nic_pci(info, bus, len(bus)):
            address = ffi.string(bus).decode()
        elif info.nic != ffi.NULL and info.nic.device_attr != ffi.NULL:
            address = rdma_device_bus(string(info.nic.device_attr.name), sysfs)
        else:
            address = None
        if address:
            seen.add(name)
            nics.append(Nic(name, address, lib.tut_nic_speed(info) / 1e9))
    return nics


def rdma_device_bus(device, sysfs=SYSFS):
    """The PCI address of RDMA device `device` (e.g. mlx5_0), from the link
    class/infiniband/<device>/device into the PCI tree; None when there is none.
    verbs names the device in fi_info's nic but gives no bus attributes
    (prov/verbs/src/verbs_info.c fills device and link attributes only)."""
    link = Path(sysfs) / "class" / "infiniband" / device / "device"
    if not device or not link.exists():
        return None
    address = os.path.basename(os.path.realpath(link))
    return address if address.count(":") == 2 else None


def ranges(values):
    """[0, 1, 2, 5, 6] -> '0-2,5-6'"""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else str(v))
            start = None
    return ",".join(out)


def worker_cores(gpus, groups, sysfs=SYSFS):
    """The core to pin each group's worker thread to (chapter 12): for GPUs, the core
    layout() picked for each; for groups of host memory, the middle core of an even
    share of the physical cores. Only cores this process may run on are used."""
    allowed = os.sched_getaffinity(0)
    if gpus:
        buses, why = gpus_here()
        if not buses:
            raise ValueError(f"no GPU to pin workers next to: {why}")
        picked = [layout(buses, [], sysfs)[g].core for g in gpus]
        if all(core in allowed for core in picked):
            return picked
    cores = [c for node in physical_cores(sysfs).values() for c in node if c in allowed]
    cores = cores or sorted(allowed)
    share = max(1, len(cores) // groups)
    return [cores[min(g * share + share // 2, len(cores) - 1)] for g in range(groups)]

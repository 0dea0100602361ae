"""Fake /sys trees for the topology tests: PCIe switches, NUMA nodes, hyperthreads.

A box is a list of switches; each switch sits below a root port and holds
endpoints (GPUs, NICs, and what else a GPU server has on its PCI bus). Devices
get the sysfs files chapter 08 and the doctor read: bus/pci/devices/<address>
links into devices/pci..., numa_node, vendor, device and class, and per CPU
topology/thread_siblings_list; RDMA devices that verbs names (it gives no PCI
address) the link class/infiniband/<name>/device.

The machine description a box returns (chapter 08's --machine) lists the GPUs
as CUDA lists them when it sees all, and the NICs as libfabric does; with
`visible`, the GPUs this process sees (CUDA_VISIBLE_DEVICES, Slurm's
--gpus-per-task, torchrun's one GPU a rank), as indexes into "gpus".
"""
import json
import os
from pathlib import Path

NVIDIA, AMAZON, MELLANOX, ASPEED = "0x10de", "0x1d0f", "0x15b3", "0x1a03"
# Of each kind of endpoint, what sysfs's vendor, device and class files hold. A kind
# "gpu:MODEL" or "nic:GEN" is a "gpu" or "nic" of that model; the bare kinds are the p5's.
# The device ids past the H100's and the first EFA's are illustrative: only the vendor and
# class decide what the code finds.
IDS = {"gpu": (NVIDIA, "0x2330", "0x030200"),       # H100 SXM5: a 3D controller
       "gpu:h200": (NVIDIA, "0x2335", "0x030200"),
       "gpu:b200": (NVIDIA, "0x2901", "0x030200"),
       "gpu:b300": (NVIDIA, "0x3182", "0x030200"),
       "nic": (AMAZON, "0xefa1", "0x020000"),       # EFA: an Ethernet controller
       "nic:efa3": (AMAZON, "0xefa2", "0x020000"),
       "nic:efa4": (AMAZON, "0xefa3", "0x020000"),
       "verbs": (MELLANOX, "0x1021", "0x020700"),   # ConnectX-7: an InfiniBand controller
       "nvswitch": (NVIDIA, "0x22a3", "0x068000"),  # NVIDIA's, but a bridge: no GPU
       "vga": (ASPEED, "0x2000", "0x030000")}       # the BMC's display: a GPU's class, not NVIDIA's

# The p5 of the series (blog-series.md): per GPU, its bus and its 4 NICs' buses.
P5_GPUS = [0x53, 0x64, 0x75, 0x86, 0x97, 0xa8, 0xb9, 0xca]
P5_NIC_NAMES = [79, 96, 113, 130, 147, 164, 181, 198]  # rdmap<N>s0, first of each 4
# A ConnectX-7 box (DGX H100-like): 8 GPUs, each behind its own switch with its NICs.
CX7_GPUS = [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb]


def addr(bus, dev=0, fn=0):
    return f"0000:{bus:02x}:{dev:02x}.{fn}"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def device(root, chain, numa, kind):
    """Create the device of `kind` (IDS) at the end of `chain` (root port first) and its
    bus/pci link; returns its directory."""
    rc = "pci" + chain[0][:7]  # 'pci0000:00'
    real = root / "devices" / rc / Path(*chain)
    write(real / "numa_node", str(numa))
    for name, value in zip(("vendor", "device", "class"), IDS[kind]):
        write(real / name, value)
    symlink(root / "bus" / "pci" / "devices" / chain[-1], real)
    return real


def symlink(link, target):
    """A link to `target` relative to the link's own folder, as sysfs's are
    (../../../devices/...): it holds whether the root was given relative or absolute."""
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(os.path.relpath(target, link.parent))


def cpus(root, nodes, threads_per_core=2):
    """`nodes`: physical core count per NUMA node (None: no NUMA information at all).
    Sibling hyperthreads are numbered after all the cores, as on most Linux boxes."""
    counts = nodes or [8]
    total = sum(counts)
    system = root / "devices" / "system"
    start = 0
    for node, count in enumerate(counts):
        cores = list(range(start, start + count))
        threads = [c + t * total for t in range(threads_per_core) for c in cores]
        if nodes is not None:
            write(system / "node" / f"node{node}" / "cpulist",
                  ",".join(f"{c[0]}-{c[-1]}" for c in [threads[i:i + count]
                                                       for i in range(0, len(threads), count)]))
        for cpu in threads:
            siblings = [cpu % total + t * total for t in range(threads_per_core)]
            write(system / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list",
                  ",".join(map(str, siblings)))
        start += count
    write(system / "cpu" / "online", f"0-{total * threads_per_core - 1}")


def box(root, switches, nodes, visible=None):
    """`switches`: [(numa, root complex bus, [(kind, name, endpoint bus, gbps)])], kind
    "gpu", "nic" (its PCI address known, as efa gives it), "verbs" (found through
    class/infiniband only), or another of IDS (on the bus, in no description). Returns the
    machine description chapter 08 takes with --machine; `visible`: the GPUs this process
    sees, indexes into its "gpus" (None: all)."""
    machine = {"gpus": [], "nics": []}
    for i, (numa, rc_bus, endpoints) in enumerate(switches):
        root_port = addr(rc_bus, 1 + i)
        up = addr(endpoints[0][2] - 2)
        for k, (kind, name, bus, gbps) in enumerate(endpoints):
            down = addr(endpoints[0][2] - 1, k)
            real = device(root, [root_port, up, down, addr(bus)], numa, kind)
            if kind.split(":")[0] == "gpu":
                machine["gpus"].append(addr(bus))
            elif kind.split(":")[0] == "nic":
                machine["nics"].append({"name": name, "bus": addr(bus), "gbps": gbps})
            elif kind == "verbs":
                symlink(root / "class" / "infiniband" / name / "device", real)
                machine["nics"].append({"name": name, "gbps": gbps})
    if visible is not None:
        machine["visible"] = list(visible)
    cpus(root, nodes)
    return machine


def eight_gpus(root, gpu_buses, nics_of, nodes, visible=None):
    """An 8-GPU server: each GPU behind its own PCIe switch with the NICs `nics_of(g,
    gpu_bus)` gives ([(kind, name, bus, gbps)]); GPUs 0-3 on NUMA 0, 4-7 on NUMA 1;
    `nodes`: physical cores per node. Beside them what else such a server has on its
    PCI bus: the BMC's display (a VGA controller) and 4 NVSwitches (NVIDIA's, bridges)."""
    switches = [(g // 4, 0x00 if g < 4 else 0x80, nics_of(g, bus) + [("gpu", None, bus, 0)])
                for g, bus in enumerate(gpu_buses)]
    switches.append((0, 0x00, [("vga", None, 0x03, 0)]))
    switches.append((1, 0x80, [("nvswitch", None, 0xe4 + k, 0) for k in range(4)]))
    return box(root, switches, nodes, visible)


def efa_instance(root, gpu, nic, per_gpu, gbps, visible=None):
    """An EFA instance of 8 GPUs of kind `gpu`, each behind its own PCIe switch with
    `per_gpu` EFA NICs of kind `nic` and `gbps` each, on the buses just below the GPU's
    (the p5's layout, kept for the others: their bus numbers are illustrative, the
    counts and speeds are AWS's). efa names a NIC by its bus in decimal: rdmap79s0 is
    0000:4f:00.0. GPUs 0-3 on NUMA 0; 2 x 48 cores, 2 threads each (192 vCPUs)."""
    return eight_gpus(root, P5_GPUS, lambda g, bus: [
        (nic, f"rdmap{bus - per_gpu + k}s0", bus - per_gpu + k, gbps) for k in range(per_gpu)],
        nodes=[48, 48], visible=visible)


def p5(root, visible=None):
    """p5.48xlarge (2023): 8 H100, 32 EFA NICs of 100 Gbps, 4 behind each GPU's switch."""
    return efa_instance(root, "gpu", "nic", 4, 100, visible)


def p5en(root, visible=None):
    """p5en.48xlarge (2024): 8 H200, 16 EFAv3 NICs of 200 Gbps, 2 a GPU: 3200 Gbps."""
    return efa_instance(root, "gpu:h200", "nic:efa3", 2, 200, visible)


def p6_b200(root, visible=None):
    """p6-b200.48xlarge (2025): 8 B200, 8 EFAv4 NICs of 400 Gbps, 1 a GPU: 3200 Gbps."""
    return efa_instance(root, "gpu:b200", "nic:efa4", 1, 400, visible)


def p6_b300(root, visible=None):
    """p6-b300.48xlarge (2025): 8 B300, 16 EFAv4 NICs of 400 Gbps, 2 a GPU: 6400 Gbps."""
    return efa_instance(root, "gpu:b300", "nic:efa4", 2, 400, visible)


def cx7(root, per_gpu, visible=None):
    """8 GPUs with `per_gpu` ConnectX-7 NICs each (mlx5_0, mlx5_1, ...; 400 Gbps shared
    among a GPU's), behind the GPU's own switch; GPUs 0-3 on NUMA 0; 2 x 56 cores."""
    return eight_gpus(root, CX7_GPUS, lambda g, bus: [
        ("verbs", f"mlx5_{g * per_gpu + k}", bus - per_gpu + k, 400 // per_gpu)
        for k in range(per_gpu)], nodes=[56, 56], visible=visible)


# Each machine by the name tests/programs/fake_sysfs.py's command line takes: (root, visible) -> its
# description. cx7: one 400 Gbps NIC a GPU, as a DGX H100's compute fabric has.
INSTANCES = {"p5": p5, "p5en": p5en, "p6_b200": p6_b200, "p6_b300": p6_b300,
             "cx7": lambda root, visible=None: cx7(root, 1, visible)}
# NICs a GPU and Gbps in all, of each EFA instance (what chapter 08 shows on it).
EFA_SHAPES = {"p5": (4, 3200), "p5en": (2, 3200), "p6_b200": (1, 3200), "p6_b300": (2, 6400)}


def pretend(monkeypatch, root, machine):
    """Make common.engine.topo find `machine` (built under `root`) as chapters 09-19 would
    on it: CUDA's GPUs (the visible ones), libfabric's NICs, the PCI tree under `root`."""
    from common.engine import topo
    seen = [machine["gpus"][i] for i in machine.get("visible", range(len(machine["gpus"])))]
    layout = topo.layout
    monkeypatch.setattr(topo, "gpus_here", lambda: (seen, None))
    monkeypatch.setattr(topo, "nics_here", lambda head, sysfs=None: [  # fresh: layout marks them
        topo.Nic(n["name"], n.get("bus") or topo.rdma_device_bus(n["name"], root), n["gbps"])
        for n in machine["nics"]])
    monkeypatch.setattr(topo, "layout", lambda buses, nics, sysfs=None: layout(buses, nics, root))


def save(root, machine):
    path = Path(root) / "machine.json"
    path.write_text(json.dumps(machine))
    return path


# .venv/bin/python tests/programs/fake_sysfs.py DIR [NAME]: to try chapter 08 on a machine
if __name__ == "__main__":
    import sys
    if len(sys.argv) not in (2, 3) or sys.argv[2:3] and sys.argv[2] not in INSTANCES:
        sys.exit("usage: .venv/bin/python tests/programs/fake_sysfs.py DIR "
                 f"[{'|'.join(INSTANCES)}] "
                 "(default p5)")
    root = Path(sys.argv[1])
    from common.cli import command
    machine = INSTANCES[sys.argv[2] if len(sys.argv) == 3 else "p5"](root)
    print(command("--sysfs", root, "--machine", save(root, machine),
                  program=Path(__file__).resolve().parents[2] / "chapters" / "08_topo.py"))

"""Fake /sys trees for the topology tests: PCIe switches, NUMA nodes, hyperthreads.

A box is a list of switches; each switch sits below a root port and holds
endpoints (GPUs, NICs). Devices get the sysfs files chapter 08 reads:
bus/pci/devices/<address> links into devices/pci..., numa_node, and per CPU
topology/thread_siblings_list; RDMA devices that verbs names (it gives no PCI
address) the link class/infiniband/<name>/device.
"""
import json
import os
from pathlib import Path

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


def device(root, chain, numa):
    """Create the device at the end of `chain` (root port first) and its bus/pci link;
    returns its directory."""
    rc = "pci" + chain[0][:7]  # 'pci0000:00'
    real = root / "devices" / rc / Path(*chain)
    write(real / "numa_node", str(numa))
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


def box(root, switches, nodes):
    """`switches`: [(numa, root complex bus, [(kind, name, endpoint bus, gbps)])], kind
    "gpu", "nic" (its PCI address known, as efa gives it) or "verbs" (found through
    class/infiniband only). Returns the machine description chapter 08 takes with
    --machine."""
    machine = {"gpus": [], "nics": []}
    for i, (numa, rc_bus, endpoints) in enumerate(switches):
        root_port = addr(rc_bus, 1 + i % 8)
        up = addr(endpoints[0][2] - 2)
        for k, (kind, name, bus, gbps) in enumerate(endpoints):
            down = addr(endpoints[0][2] - 1, k)
            real = device(root, [root_port, up, down, addr(bus)], numa)
            if kind == "gpu":
                machine["gpus"].append(addr(bus))
            elif kind == "nic":
                machine["nics"].append({"name": name, "bus": addr(bus), "gbps": gbps})
            else:
                symlink(root / "class" / "infiniband" / name / "device", real)
                machine["nics"].append({"name": name, "gbps": gbps})
    cpus(root, nodes)
    return machine


def p5(root):
    """8 GPUs x 4 EFA NICs of 100 Gbps, GPUs 0-3 on NUMA 0, 96 cores, 2 threads each."""
    switches = []
    for g, (gpu_bus, nic) in enumerate(zip(P5_GPUS, P5_NIC_NAMES)):
        nics = [("nic", f"rdmap{nic + k}s0", gpu_bus - 4 + k, 100) for k in range(4)]
        switches.append((g // 4, 0x00 if g < 4 else 0x80, nics + [("gpu", None, gpu_bus, 0)]))
    return box(root, switches, nodes=[48, 48])


def cx7(root, per_gpu):
    """8 GPUs with `per_gpu` ConnectX-7 NICs each (mlx5_0, mlx5_1, ...; 400 Gbps shared
    among a GPU's), behind the GPU's own switch; GPUs 0-3 on NUMA 0; 2 x 56 cores."""
    switches = []
    for g, gpu_bus in enumerate(CX7_GPUS):
        nics = [("verbs", f"mlx5_{g * per_gpu + k}", gpu_bus - per_gpu + k, 400 // per_gpu)
                for k in range(per_gpu)]
        switches.append((g // 4, 0x00 if g < 4 else 0x80, nics + [("gpu", None, gpu_bus, 0)]))
    return box(root, switches, nodes=[56, 56])


def save(root, machine):
    path = Path(root) / "machine.json"
    path.write_text(json.dumps(machine))
    return path


if __name__ == "__main__":  # .venv/bin/python tests/fake_sysfs.py DIR: the p5, to try chapter 08 on
    import sys
    if len(sys.argv) != 2:
        sys.exit("usage: .venv/bin/python tests/fake_sysfs.py DIR")
    root = Path(sys.argv[1])
    from common.cli import command
    print(command("--sysfs", root, "--machine", save(root, p5(root)),
                  program=Path(__file__).resolve().parents[1] / "chapters" / "08_topo.py"))

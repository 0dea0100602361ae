"""Chapter 08 - topo: which NICs and which CPU cores belong to which GPU.

What you will learn: on a p5 each GPU sits behind its own PCIe switch with
4 EFA NICs. A WRITE from a GPU through a NIC behind another switch crosses
the root complex, or the link between the sockets, and loses bandwidth; a
thread polling a GPU's NICs from a core of the other NUMA node pays for every
cache line it touches. So before using 32 NICs, find out what goes with what:
the GPUs' PCI addresses from CUDA, the NICs' from fi_info (nic->bus_attr;
verbs gives none: its device's link in /sys/class/infiniband), the PCIe
tree and the NUMA nodes from sysfs, and the hyperthread siblings, which are
left out so that each pinned thread gets a core of its own.

Lay out the whole machine, not only the GPUs this process sees: under Slurm's
--gpus-per-task or torchrun a process sees only its own GPU (as cuda:0), and
laid out alone that GPU would take all 32 NICs, half of them across the link
between the sockets, and every core of its NUMA node. The machine's GPUs are
on the PCI bus (sysfs: NVIDIA's vendor id, a GPU's class); the ones CUDA
shows are found among them by their PCI addresses.

New since chapter 07: a standalone program, no endpoint at all. The
discovery lives in common/engine/topo.py, for chapters 09 on.

    .venv/bin/python chapters/08_topo.py                  # this machine, default provider
    .venv/bin/python chapters/08_topo.py -p efa
    .venv/bin/python chapters/08_topo.py --sysfs DIR --machine FILE   # a described machine (tests)
    CUDA_VISIBLE_DEVICES=3 .venv/bin/python chapters/08_topo.py       # as a rank of GPU 3 sees it
    .venv/bin/python tests/programs/fake_sysfs.py "$(mktemp -d)"   # the series' p5, faked: prints the line above for it
    .venv/bin/python tests/programs/fake_sysfs.py "$(mktemp -d)" p6_b300   # or p5en, p6_b200, cx7

Transcripts (a 2-core VM, one H200, the fake p5): results/08_topo/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## Motivation
#     GPUs on the PCI bus (/sys)  NIC bus ids (fi_info)  /sys: PCIe tree, NUMA, CPU siblings
#            \                   |                          /
#             NIC -> GPU sharing its PCIe switch (else: by NUMA node)
#             NUMA node's physical cores -> split among its GPUs -> one core each
#             the GPUs CUDA sees (bus ids) -> their rows: cuda:0, cuda:1, ...

# %%
import json
from pathlib import Path

from common import cli
from common.engine import topo
import common.fabric as fi


def describe(args):
    """(bus ids of the GPUs this process sees, [Nic], what they came from) for this machine
    or for --machine, where a NIC without a "bus" is an RDMA device, found in sysfs as
    verbs' are, and "visible" (indexes into "gpus") names the GPUs the process sees."""
    if args.machine:
        try:
            data = json.loads(Path(args.machine).read_text())
            seen = data.get("visible", range(len(data["gpus"])))
            if any(not isinstance(i, int) or not 0 <= i < len(data["gpus"]) for i in seen):
                raise ValueError(f"\"visible\" {data['visible']}: not indexes into \"gpus\" "
                                 f"(0..{len(data['gpus']) - 1})")
            nics = [topo.Nic(n["name"], n.get("bus") or topo.rdma_device_bus(n["name"],
                                                                             args.sysfs),
                             n.get("gbps", 0)) for n in data["nics"]]
            lost = [n.name for n in nics if not n.bus]
            if lost:
                raise ValueError(f"no bus given and no class/infiniband/{lost[0]} in "
                                 f"{args.sysfs}")
            return ([data["gpus"][i] for i in seen], nics, f"described in {args.machine}",
                    "described")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise cli.UsageError(f"--machine {args.machine}: {e}") from None
    gpus, why = topo.gpus_here()
    info, _ = fi.pick(args.provider, fi.lib.FI_RMA)
    provider = fi.provider_of(info).split(";")[0]
    return gpus, topo.nics_here(info, args.sysfs), why or "CUDA", provider


# %% [markdown]
# ## Code

# %%
def main():
    p = cli.parser(__doc__)
    p.add_argument("--sysfs", default=str(topo.SYSFS), help="root of sysfs (default /sys)")
    p.add_argument("--machine", help="JSON with 'gpus' (PCI addresses), 'nics' (name, bus, "
                   "gbps) and optionally 'visible' (the GPUs this process sees, indexes into "
                   "'gpus') instead of asking CUDA and libfabric")
    args = p.parse_args()
    if not Path(args.sysfs).is_dir():
        raise cli.UsageError(f"--sysfs {args.sysfs}: no such directory")
    gpu_buses, nics, gpu_source, nic_source = describe(args)
    cores = topo.physical_cores(args.sysfs)
    gpus = topo.machine_layout(gpu_buses, nics, args.sysfs)
    seen = (f", {len(gpu_buses)} of them seen by this process" if len(gpu_buses) < len(gpus)
            else "")
    print(f"GPUs: {len(gpus)}{seen} ({gpu_source}); NICs: {len(nics)} ({nic_source}); "
          f"NUMA nodes: {len(cores)}; physical cores: {sum(map(len, cores.values()))}")
    if not nics:
        print(f"no NIC with a PCI address from {nic_source}: chapters 09+ open several "
              "domains of it instead, as virtual NICs")
    if not gpu_buses:
        print(f"no GPU{' seen' * bool(gpus)}: chapters 09+ run on host memory; NICs by "
              "NUMA node:")
        for node, cpus in cores.items():
            mine = [n.name for n in nics if (n.numa if n.numa is not None else 0) == node]
            print(f"  NUMA {node}: cores {topo.ranges(cpus)}; NICs: {' '.join(mine) or '-'}")
    else:
        print(f"{'GPU':<7} {'bus':<13} {'NUMA':<5} {'cores':<12} {'pinned':<7} NICs")
        for g in gpus:
            name = "-" if g.index is None else g.name()  # '-': a GPU this process does not see
            print(f"{name:<7} {g.bus:<13} {'-' if g.numa is None else g.numa:<5} "
                  f"{topo.ranges(g.cores) or '-':<12} {'-' if g.core is None else g.core:<7} "
                  f"{' '.join(n.name for n in g.nics) or '-'}")
        for g in gpus:
            for n in g.nics:
                if n.numa is not None and g.numa is not None and n.numa != g.numa:
                    print(f"note: {n.name} is on NUMA node {n.numa}, {g.name()} on "
                          f"{g.numa}: their traffic crosses the link between the sockets")
    total = sum(n.gbps for n in nics)
    print(f"total link bandwidth: {len(nics)} NICs, {total:g} Gbps" if total else
          "total link bandwidth: unknown (no NIC reports a link speed)")


if __name__ == "__main__":
    cli.run(main)

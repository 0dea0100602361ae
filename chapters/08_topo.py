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

New since chapter 07: a standalone program, no endpoint at all. The
discovery lives in common/engine/topo.py, for chapters 09 on.

    .venv/bin/python chapters/08_topo.py                  # this machine, default provider
    .venv/bin/python chapters/08_topo.py -p efa
    .venv/bin/python chapters/08_topo.py --sysfs DIR --machine FILE   # a described machine (tests)

Transcript (2-core x86_64 VM, no GPU, no NIC, Debian's libfabric 1.17, commit 51c3160,
load average 2.8):

    $ .venv/bin/python chapters/08_topo.py
    GPUs: 0 (no cupy, so no CUDA); NICs: 0 (shm); NUMA nodes: 1; physical cores: 2
    no NIC with a PCI address from shm: chapters 09+ open several domains of it instead, as virtual NICs
    no GPU: chapters 09+ run on host memory; NICs by NUMA node:
      NUMA 0: cores 0-1; NICs: -
    total link bandwidth: unknown (no NIC reports a link speed)

One H200 machine (16 cores, one NUMA node; its GPU reports no NUMA node; libfabric 2.1.0
with CUDA, whose shm has no NIC address; commit 7bf55eb):

    $ .venv/bin/python chapters/08_topo.py
    GPUs: 1 (CUDA); NICs: 0 (shm); NUMA nodes: 1; physical cores: 16
    no NIC with a PCI address from shm: chapters 09+ open several domains of it instead, as virtual NICs
    GPU     bus           NUMA  cores        pinned  NICs
    cuda:0  0000:00:06.0  -     0-15         8       -
    total link bandwidth: unknown (no NIC reports a link speed)

The series' p5, rebuilt as a fake sysfs tree by `.venv/bin/python tests/fake_sysfs.py /tmp/p5`
(8 H100s, each behind its own PCIe switch with 4 EFA NICs; 2 NUMA nodes; 96 cores,
2 threads each; the same VM and commit):

    $ .venv/bin/python chapters/08_topo.py --sysfs /tmp/p5 --machine /tmp/p5/machine.json
    GPUs: 8 (described in /tmp/p5/machine.json); NICs: 32 (described); NUMA nodes: 2; physical cores: 96
    GPU     bus           NUMA  cores        pinned  NICs
    cuda:0  0000:53:00.0  0     0-11         6       rdmap79s0 rdmap80s0 rdmap81s0 rdmap82s0
    cuda:1  0000:64:00.0  0     12-23        18      rdmap96s0 rdmap97s0 rdmap98s0 rdmap99s0
    cuda:2  0000:75:00.0  0     24-35        30      rdmap113s0 rdmap114s0 rdmap115s0 rdmap116s0
    cuda:3  0000:86:00.0  0     36-47        42      rdmap130s0 rdmap131s0 rdmap132s0 rdmap133s0
    cuda:4  0000:97:00.0  1     48-59        54      rdmap147s0 rdmap148s0 rdmap149s0 rdmap150s0
    cuda:5  0000:a8:00.0  1     60-71        66      rdmap164s0 rdmap165s0 rdmap166s0 rdmap167s0
    cuda:6  0000:b9:00.0  1     72-83        78      rdmap181s0 rdmap182s0 rdmap183s0 rdmap184s0
    cuda:7  0000:ca:00.0  1     84-95        90      rdmap198s0 rdmap199s0 rdmap200s0 rdmap201s0
    total link bandwidth: 32 NICs, 3200 Gbps
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## Motivation
#     GPU bus ids (CUDA)  NIC bus ids (fi_info)  /sys: PCIe tree, NUMA, CPU siblings
#            \                   |                          /
#             NIC -> GPU sharing its PCIe switch (else: by NUMA node)
#             NUMA node's physical cores -> split among its GPUs -> one core each

# %%
import json
from pathlib import Path

from common import cli
from common.engine import topo
import common.fabric as fi


def describe(args):
    """(GPU bus ids, [Nic], what they came from) for this machine or for --machine,
    where a NIC without a "bus" is an RDMA device, found in sysfs as verbs' are."""
    if args.machine:
        try:
            data = json.loads(Path(args.machine).read_text())
            nics = [topo.Nic(n["name"], n.get("bus") or topo.rdma_device_bus(n["name"],
                                                                             args.sysfs),
                             n.get("gbps", 0)) for n in data["nics"]]
            lost = [n.name for n in nics if not n.bus]
            if lost:
                raise ValueError(f"no bus given and no class/infiniband/{lost[0]} in "
                                 f"{args.sysfs}")
            return data["gpus"], nics, f"described in {args.machine}", "described"
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
    p.add_argument("--machine", help="JSON with 'gpus' (PCI addresses) and 'nics' "
                   "(name, bus, gbps) instead of asking CUDA and libfabric")
    args = p.parse_args()
    if not Path(args.sysfs).is_dir():
        raise cli.UsageError(f"--sysfs {args.sysfs}: no such directory")
    gpu_buses, nics, gpu_source, nic_source = describe(args)
    cores = topo.physical_cores(args.sysfs)
    gpus = topo.layout(gpu_buses, nics, args.sysfs)
    print(f"GPUs: {len(gpus)} ({gpu_source}); NICs: {len(nics)} ({nic_source}); "
          f"NUMA nodes: {len(cores)}; physical cores: {sum(map(len, cores.values()))}")
    if not nics:
        print(f"no NIC with a PCI address from {nic_source}: chapters 09+ open several "
              "domains of it instead, as virtual NICs")
    if not gpus:
        print("no GPU: chapters 09+ run on host memory; NICs by NUMA node:")
        for node, cpus in cores.items():
            mine = [n.name for n in nics if (n.numa if n.numa is not None else 0) == node]
            print(f"  NUMA {node}: cores {topo.ranges(cpus)}; NICs: {' '.join(mine) or '-'}")
    else:
        print(f"{'GPU':<7} {'bus':<13} {'NUMA':<5} {'cores':<12} {'pinned':<7} NICs")
        for g in gpus:
            print(f"{'cuda:' + str(g.index):<7} {g.bus:<13} {'-' if g.numa is None else g.numa:<5} "
                  f"{topo.ranges(g.cores) or '-':<12} {'-' if g.core is None else g.core:<7} "
                  f"{' '.join(n.name for n in g.nics) or '-'}")
        for g in gpus:
            for n in g.nics:
                if n.numa is not None and g.numa is not None and n.numa != g.numa:
                    print(f"note: {n.name} is on NUMA node {n.numa}, cuda:{g.index} on "
                          f"{g.numa}: their traffic crosses the link between the sockets")
    total = sum(n.gbps for n in nics)
    print(f"total link bandwidth: {len(nics)} NICs, {total:g} Gbps" if total else
          "total link bandwidth: unknown (no NIC reports a link speed)")


if __name__ == "__main__":
    cli.run(main)

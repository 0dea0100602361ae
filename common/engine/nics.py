"""Which NICs each user drives, chosen in one place: the lanes of chapters 09-15
(multinet), a rank's proxy in the MoE chapters 16-17 and a process's transfer engine
under chapters 18-19.

Chapter 08's topology (topo.py) reads the machine; this module chooses from it. A GPU's
memory goes out through its own NICs, those behind its PCIe switch (on a p5, 4 of them),
since a WRITE through another GPU's NIC would cross the root complex: the same ones
whether the process sees all the GPUs or only its own (Slurm, torchrun). Host memory takes
an even share of the node's, in order. Where no NIC has a PCI address (shm, or tcp on a
laptop), a NIC is virtual: one more domain of that provider, so that the code of many
NICs runs anywhere. Of each NIC, the entry taken is of the control endpoint's kind
(nic_entries): a lane of another kind could not reach its peer. Which share is a rank's
follows from its place on its node: the MoE proxy's group says it, and the transfer
engine reads it from the launcher's variables (launch.place_from_environment).
"""
import common.fabric as fi
from common.engine import topo


def lane_nics(args, head, groups, per_group):
    """The fi_info of each lane of chapters 09-15, group by group, and a line saying what
    the NICs are: each of args.gpus' own, or the node's split evenly among `groups` of host
    memory. `per_group` None: every NIC of each group (one virtual NIC where there are
    none)."""
    by_name = nic_entries(head)
    nics = [nic for nic in topo.nics_here(head) if nic.name in by_name]
    if not nics:
        per_group = per_group or 1
        return ([[head] * per_group for _ in range(groups)],
                f"{groups} x {per_group} virtual NICs: independent domains of "
                f"{args.provider_used} (no NIC with a PCI address here)")
    mine = nics_near_gpus(nics, args.gpus) if args.gpus else split_among(nics, groups)
    chosen = first_of_each(mine, per_group)
    return ([[by_name[n.name] for n in group] for group in chosen],
            f"{groups} x {len(chosen[0])} NICs: " + "; ".join(" ".join(n.name for n in group)
                                                           for group in chosen))


def rank_nics(head, place, gpu, count=None):
    """The fi_info of each NIC one rank drives (the MoE proxy; a transfer engine), and a
    line saying which: its GPU's NICs (nics_near_gpus; for host memory, its share of the
    node's by its `place`, a launch.Place), the first `count` of them; or `count`
    (default 1) virtual NICs where no NIC has a PCI address."""
    nics = topo.nics_here(head)
    provider = fi.provider_of(head)
    if not nics:
        count = count or 1
        return fi.rules.virtual_nics(head, count), (
            f"{count} virtual NIC{'s' * (count > 1)}, each a domain of {provider} "
            "(no NIC with a PCI address here)")
    mine = (nics_near_gpus(nics, [gpu])[0] if gpu is not None
            else node_share(nics, place.rank % place.ranks_per_node, place.ranks_per_node))
    mine = first_of_each([mine], count)[0]
    entries = nic_entries(head)  # of each NIC, an entry of the head's kind
    other = [n.name for n in mine if n.name not in entries]
    if other:
        raise ValueError(f"NIC {other[0]} is not in fabric {fi.string(head.fabric_attr.name)} "
                         "with the first entry's address format")
    whose = f"GPU {gpu}'s" if gpu is not None else "a share of the node's"
    return ([entries[n.name] for n in mine],
            f"{len(mine)} NIC{'s' * (len(mine) > 1)} ({whose}): {' '.join(n.name for n in mine)}")


def nic_entries(head):
    """{domain name: the fi_info its lane opens}: of each name, an entry with the provider and
    address format of the control endpoint (the head) and its fabric: only that fabric where
    we chose it by name (fi.FABRICS), else that one first. One name stands for several
    entries: efa-direct and efa share the "-rdm" domain names (prov/efa/src/efa_domain.h),
    verbs and tcp list IPv4 and IPv6 for each NIC; verbs names a fabric per IB subnet, so
    each rail may have its own (prov/verbs/src/verbs_info.c). A lane of another kind could
    not reach its peer, or would follow another fabric's rules."""
    def fabric(info):
        return fi.string(info.fabric_attr.name)

    def usable(info):
        return ((fi.provider_of(info), info.addr_format)
                == (fi.provider_of(head), head.addr_format)
                and (fi.provider_of(head) not in fi.FABRICS or fabric(info) == fabric(head)))
    lanes = {}
    for info in filter(usable, fi.each(head)):
        name = fi.string(info.domain_attr.name)
        if name not in lanes or fabric(info) == fabric(head) != fabric(lanes[name]):
            lanes[name] = info
    return lanes


def nics_near_gpus(nics, gpus):
    """Each of `gpus`' NICs ([Nic] per CUDA number), as chapter 08's topo.layout gives them
    in the layout of the whole machine, however few of its GPUs this process sees. A GPU
    that owns none (fewer NICs than GPUs) shares those of its NUMA node, else all of them."""
    gpu_buses, _ = topo.gpus_here()
    layout = topo.layout(gpu_buses, nics)
    if max(gpus) >= len(layout):
        raise ValueError(f"no GPU {max(gpus)} in the topology (this process sees "
                         f"{len(layout)} GPUs)")
    return [layout[g].nics or [n for n in nics if n.numa == layout[g].numa] or nics
            for g in gpus]


def split_among(nics, groups):
    """All NICs shared out among `groups` stand-ins for GPUs (host memory), in order."""
    if not nics or len(nics) % groups:
        raise ValueError(f"{len(nics)} NICs do not split evenly among {groups} groups")
    per = len(nics) // groups
    return [nics[g * per:(g + 1) * per] for g in range(groups)]


def node_share(nics, local_rank, ranks_per_node):
    """The even share of a node's NICs that one of its ranks takes, in order (one of them
    when there are fewer NICs than ranks)."""
    n = len(nics)
    if n < ranks_per_node:
        return [nics[local_rank % n]]
    return nics[local_rank * n // ranks_per_node:(local_rank + 1) * n // ranks_per_node]


def first_of_each(groups, per_group):
    """The first `per_group` NICs of each group (None: all), if that uses them evenly."""
    have = min(len(g) for g in groups)
    per_group = per_group or have
    if per_group > have:
        raise ValueError(f"asked for {per_group} NICs per GPU; a GPU here has only {have}")
    if have % per_group:
        raise ValueError(f"{have} NICs per GPU do not split evenly into {per_group}")
    return [g[:per_group] for g in groups]

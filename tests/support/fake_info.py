"""fi_info lists made by hand, for what no provider lists on this host: several fabrics
and address formats for one domain name, NICs with PCI addresses, an efa or a verbs.

    head = fake_info.infos(
        fake_info.Entry("rdmap79s0-rdm", fabric="efa-direct", pci="0000:4f:00.0"),
        fake_info.Entry("rdmap79s0-rdm", fabric="efa", pci="0000:4f:00.0"))
    fi.each(head), topo.nics_here(head), nics.nic_entries(head), ...

Each entry is an fi_allocinfo'd fi_info, linked by `next`, with what Entry says; the
list is fi_freeinfo'd when `head` is collected. A NIC's attributes belong to the list
(their fid has no ops, so fi_freeinfo leaves them): never fi_dupinfo such an entry.
Nothing here opens: a fake entry given to fi_fabric is refused or worse.

The choosing code (fi.pick, cli.pick_provider, the tour's fi.pick(-p)) is tested
with such entries standing in for NICs: `pretend(monkeypatch, present, absent)` makes
fi.getinfo answer for the providers named, and FAKE_NICS=1 in the environment makes
efa and verbs look present to every test in the test process (conftest.py), so

    FAKE_NICS=1 .venv/bin/python -m pytest

shows that no test relies on their absence. A test that needs efa or verbs absent
fakes that too, or, where the absence must be the real one (a chapter run as its own
process sees the real libfabric), skips where `really_usable` says there is a device.
"""
import os
import sys
from dataclasses import dataclass

import pytest

import common.fabric as fi
from common.fabric import ffi, lib

FAKE_NICS = os.environ.get("FAKE_NICS") == "1"
_getinfo = fi.getinfo  # the real one, whatever a test has put in its place


@dataclass
class Entry:
    domain: str                          # domain_attr.name, e.g. "rdmap79s0-rdm"
    fabric: str = "efa"                  # fabric_attr.name
    provider: str = "efa"                # fabric_attr.prov_name, e.g. "verbs;ofi_rxm"
    addr_format: int = lib.FI_ADDR_EFA
    pci: str = None                      # the NIC's PCI address, "0000:4f:00.0"; None: no NIC
    gbps: float = 0                      # its link speed
    mtu: int = 0                         # its link MTU
    caps: int = lib.FI_MSG | lib.FI_RMA
    mode: int = 0
    mr_mode: int = fi.MR_MODE
    tx_size: int = 1024
    rx_size: int = 1024
    max_msg_size: int = 1 << 30


def infos(*entries):
    """The fi_info list of `entries`, in their order: its head."""
    keep = []  # the NICs' attributes, alive as long as the list
    head = prev = ffi.NULL
    for e in entries:
        info = lib.fi_allocinfo()
        info.caps, info.mode, info.addr_format = e.caps, e.mode, e.addr_format
        info.ep_attr.type, info.ep_attr.max_msg_size = lib.FI_EP_RDM, e.max_msg_size
        info.tx_attr.size, info.rx_attr.size = e.tx_size, e.rx_size
        info.domain_attr.mr_mode = e.mr_mode
        info.domain_attr.name = lib.strdup(e.domain.encode())  # fi_freeinfo frees these
        info.fabric_attr.name = lib.strdup(e.fabric.encode())
        info.fabric_attr.prov_name = lib.strdup(e.provider.encode())
        if e.pci:
            info.nic = _nic(e, keep)
        if prev == ffi.NULL:
            head = info
        else:
            prev.next = info
        prev = info
    return ffi.gc(head, lambda head, _nics=keep: lib.fi_freeinfo(head))


def info_list(names):
    """An fi_info list with one entry per domain name (fi_allocinfo; freed with its head)."""
    head = fi.hints()
    head.domain_attr.name = lib.strdup(names[0].encode())
    last = head
    for name in names[1:]:
        last.next = lib.fi_allocinfo()
        last = last.next
        last.domain_attr.name = lib.strdup(name.encode())
    return head


def _nic(e, keep):
    domain, bus, rest = e.pci.split(":")
    device, function = rest.split(".")
    bus_attr = ffi.new("struct fi_bus_attr *", {"bus_type": lib.FI_BUS_PCI})
    bus_attr.attr.pci = {"domain_id": int(domain, 16), "bus_id": int(bus, 16),
                         "device_id": int(device, 16), "function_id": int(function, 16)}
    link = ffi.new("struct fi_link_attr *", {"mtu": e.mtu, "speed": int(e.gbps * 1e9)})
    nic = ffi.new("struct fid_nic *", {"bus_attr": bus_attr, "link_attr": link})
    keep += [bus_attr, link, nic]
    return nic


# What pretend lists for a provider: one NIC each, the shapes their fi_info has
NICS = {"efa": lambda: Entry("rdmap79s0-rdm", pci="0000:4f:00.0", gbps=100, mtu=8928),
        "verbs": lambda: Entry("mlx5_0", fabric="IB-0xfe80000000000000", provider="verbs;ofi_rxm",
                               addr_format=lib.FI_SOCKADDR_IB, pci="0000:1a:00.0", gbps=400,
                               mtu=4096)}


def pretend(monkeypatch, present=(), absent=()):
    """fi.getinfo, for hints that name a provider of `present` (efa, verbs), lists a fake
    NIC of it; for one of `absent`, fails as for a provider without a device (FI_ENODATA).
    Every other call is the real one."""
    def getinfo(hint, flags=0):
        name = fi.string(hint.fabric_attr.prov_name).split(";")[0] if hint != ffi.NULL else ""
        if name in absent:
            raise fi.FabricError("fi_getinfo", -lib.FI_ENODATA)
        if name in present:
            return infos(NICS[name]())
        return _getinfo(hint, flags)
    patch(monkeypatch, "getinfo", getinfo)


def efa_over_shm(monkeypatch, caps):
    """A fake efa entry that fi.open_endpoint opens with shm's objects underneath: shm's
    endpoint stands in for efa's. Like efa on a host whose device cannot reach GPU memory
    (efa_hmem_validate_p2p_opt: -FI_EOPNOTSUPP), it refuses FI_HMEM_P2P_REQUIRED
    (smr_ep_setopt knows no such option: -FI_ENOPROTOOPT)."""
    shm, _ = fi.pick("shm", lib.FI_MSG | lib.FI_RMA)
    for name in ("fabric_open", "domain_open", "endpoint_open"):
        patch(monkeypatch, name, lambda *args, real=getattr(fi, name): real(*args[:-1], shm))
    return infos(Entry("rdmap79s0-rdm", caps=caps))


def patch(monkeypatch, name, value):
    """fi.`name` replaced for the whole binding: for its callers through fi (chapters, scripts)
    and in each module of common.fabric that has it among its globals, where the code of the
    package reads it (pick's getinfo, open_endpoint's cq_open, Poller's cq_read)."""
    real = getattr(fi, name)
    for module in [fi] + [m for n, m in sorted(sys.modules.items())
                          if n.startswith("common.fabric.")]:
        if getattr(module, name, None) is real:
            monkeypatch.setattr(module, name, value)


def really_usable(provider):
    """Whether this host's libfabric itself, no fake, has a device for `provider`."""
    try:
        return bool(_getinfo(fi.hints(provider)))
    except fi.FabricError:
        return False


def skip_where_present(*providers):
    """For a test of another process that needs `providers` absent: skip where one has a
    device (that process sees the real libfabric, not a fake)."""
    here = [p for p in providers if really_usable(p)]
    if here:
        pytest.skip(f"{', '.join(here)} has a device here")

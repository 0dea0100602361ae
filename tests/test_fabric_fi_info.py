"""How we ask for and use fi_info on real NICs (efa, verbs), checked without one: the
fabric, the modes, FI_HMEM, CQ room, lanes of one kind, access, efa's shm path."""
import argparse
import re
from pathlib import Path

import pytest

from common import cli
from common.engine import multinet
from common.engine.nics import lane_nics
from common.fabric import memory
import common.fabric as fi
from common.fabric import lib
from tests.support import fake_info
from tests.support.fake_info import Entry, infos

ROOT = Path(__file__).resolve().parent.parent


def test_efa_hints_name_the_rdm_fabric_and_no_mode():
    """efa-direct (listed first from 2.1) needs FI_CONTEXT2 and follows other rules: we ask
    for the RDM fabric by name and offer no mode, FI_RX_CQ_DATA included."""
    efa = fi.hints("efa", caps=lib.FI_MSG | lib.FI_RMA)
    assert fi.string(efa.fabric_attr.name) == "efa"
    assert efa.mode == 0
    assert fi.hints("shm").fabric_attr.name == fi.ffi.NULL  # one fabric: nothing to choose
    assert fi.hints("efa", fabric=False).fabric_attr.name == fi.ffi.NULL  # chapter 03: all


@pytest.mark.skipif(fi.version() < (2, 1), reason="1.x's core keeps every fabric; its efa "
                    "has only one")
def test_libfabric_drops_the_entries_of_another_fabric():
    """What naming the fabric relies on, in libfabric 2.1's core (src/fabric.c)."""
    hint = fi.hints("shm")
    hint.fabric_attr.name = lib.strdup(b"efa-direct")
    with pytest.raises(fi.FabricError, match=r"ret -61"):
        fi.getinfo(hint)


def test_the_provider_line_names_the_fabric(capsys):
    cli.pick_provider(argparse.Namespace(provider="shm"))
    assert capsys.readouterr().out == "provider: shm (asked for), fabric shm, domain shm\n"


def efa_list():
    return infos(Entry("rdmap79s0-rdm", pci="0000:4f:00.0", gbps=100))


@pytest.mark.parametrize("shm", [True, False])
def test_a_benchmark_on_efa_says_its_shm_path_is_off(monkeypatch, capsys, shm):
    head = efa_list()
    monkeypatch.setattr(fi, "pick", lambda provider, caps, hmem: (head, "asked for"))
    cli.pick_provider(argparse.Namespace(provider="efa"), shm=shm)
    out = capsys.readouterr().out
    assert out.startswith("provider: efa (asked for), fabric efa, domain rdmap79s0-rdm\n")
    assert (fi.SHM_OFF in out) == (not shm)


def test_forbidding_shm_reaches_fi_setopt_only_for_efa():
    """Other providers are left alone; for efa the option goes to the endpoint before
    fi_enable (shm's endpoint stands in: it does not know the option); libfabric < 1.21
    has none (and SHM_OFF says so)."""
    info, _ = fi.pick("shm", multinet.CAPS)
    with fi.Closer() as own:
        fabric = own(fi.fabric_open(info))
        domain = own(fi.domain_open(fabric, info))
        ep = own(fi.endpoint_open(domain, info))
        fi.forbid_shm(ep, info)  # shm: nothing to do
        if fi.API_VERSION >= fi.CAN_FORBID_SHM:
            with pytest.raises(fi.FabricError, match="FI_OPT_SHARED_MEMORY_PERMITTED") as e:
                fi.forbid_shm(ep, efa_list())
            assert e.value.rc == -lib.FI_ENOPROTOOPT
        else:
            assert lib.tut_forbid_shm(ep) == -lib.FI_ENOSYS
            fi.forbid_shm(ep, efa_list())
            assert "cannot turn its shm path off" in fi.SHM_OFF


def test_gpu_memory_without_fi_hmem_stops_with_the_cause(monkeypatch):
    """A provider that refuses FI_HMEM (efa: no CUDA, P2P off, FI_EFA_USE_DEVICE_RDMA=0)
    must not hand back a list that would register GPU memory as host memory."""
    head = efa_list()

    def getinfo(hint):
        if hint.caps & lib.FI_HMEM:
            raise fi.FabricError("fi_getinfo", -lib.FI_ENODATA)
        return head
    fake_info.patch(monkeypatch, "getinfo", getinfo)
    assert fi.pick("efa", multinet.CAPS)[0] == head
    with pytest.raises(ValueError, match=r"^efa offers no FI_HMEM here, .*FI_EFA_USE_DEVICE_RDMA"):
        fi.pick("efa", multinet.CAPS, hmem=True)
    with pytest.raises(ValueError, match=r"^efa offers no FI_HMEM here"):  # the default too
        fi.pick(None, multinet.CAPS, hmem=True)


def test_fi_hmem_is_asked_for_when_given():
    try:
        info, _ = fi.pick("shm", multinet.CAPS, hmem=True)
    except ValueError as e:  # a libfabric whose shm has no FI_HMEM: said, with the fix
        assert str(e).startswith("shm offers no FI_HMEM here")
    else:
        assert info.caps & lib.FI_HMEM


@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_every_cq_has_room_for_what_can_be_in_flight(monkeypatch, provider):
    """efa-direct and verbs give the device CQ exactly the size asked for; a lane's queue
    lets fi.in_flight(info) WRITEs be in flight, and receives come on the same CQ."""
    sizes, cq_open = [], fi.cq_open
    fake_info.patch(monkeypatch, "cq_open", lambda domain, size: sizes.append(size) or
                    cq_open(domain, size))
    info, _ = fi.pick(provider, multinet.CAPS)
    with fi.Closer() as own:
        lane = multinet.Lane(own, info)
    assert len(lane.queue.busy) == fi.in_flight(info) >= 4 * info.tx_attr.size
    assert sizes == [fi.cq_size_for(info)] == [len(lane.queue.busy) + info.rx_attr.size]


def lanes(head, groups=1):
    args = argparse.Namespace(gpus=None, provider_used=fi.provider_of(head))
    infos, what = lane_nics(args, head, groups, None)
    return [(fi.string(i.domain_attr.name), fi.string(i.fabric_attr.name), i.addr_format)
            for group in infos for i in group], what


def test_lanes_keep_the_control_endpoints_fabric():
    """efa >= 2.1: efa-direct and efa share the "-rdm" domain names (efa_domain.h)."""
    head = infos(*[Entry(f"rdmap{n}s0-rdm", fabric=fabric, pci=f"0000:{n:02x}:00.0", gbps=100)
                   for fabric in ("efa", "efa-direct") for n in (79, 80)])
    got, what = lanes(head, groups=2)
    assert got == [("rdmap79s0-rdm", "efa", lib.FI_ADDR_EFA),
                   ("rdmap80s0-rdm", "efa", lib.FI_ADDR_EFA)]
    assert what == "2 x 1 NICs: rdmap79s0-rdm; rdmap80s0-rdm"


def test_lanes_keep_the_control_endpoints_fabric_where_it_comes_second():
    head = infos(Entry("a-rdm", pci="0000:10:00.0"),
                 Entry("b-rdm", fabric="efa-direct", pci="0000:11:00.0"),
                 Entry("b-rdm", pci="0000:11:00.0"),
                 Entry("a-rdm", fabric="efa-direct", pci="0000:10:00.0"))
    assert [fabric for _, fabric, _ in lanes(head)[0]] == ["efa", "efa"]


def test_lanes_keep_the_control_endpoints_address_format():
    """verbs (like tcp) lists each NIC once per address format; its fabric is the IB
    subnet (verbs_info.c), which each rail may have of its own."""
    head = infos(*[Entry(f"mlx5_{k}", fabric=f"IB-0xfe8{k:015x}", provider="verbs;ofi_rxm",
                         addr_format=fmt, pci=f"0000:{0x20 + k:02x}:00.0", gbps=400)
                   for k in range(2) for fmt in (lib.FI_SOCKADDR_IN, lib.FI_SOCKADDR_IN6)])
    assert lanes(head)[0] == [("mlx5_0", "IB-0xfe8000000000000000", lib.FI_SOCKADDR_IN),
                              ("mlx5_1", "IB-0xfe8000000000000001", lib.FI_SOCKADDR_IN)]


def test_nics_of_another_kind_only_are_no_lanes():
    """A NIC listed only by another fabric is not one the control endpoint's kind can use."""
    head = infos(Entry("a-rdm", pci="0000:10:00.0"),
                 Entry("b-rdm", fabric="efa-direct", pci="0000:11:00.0", mode=lib.FI_CONTEXT2),
                 Entry("c-rdm", addr_format=lib.FI_SOCKADDR_IN6, pci="0000:12:00.0"))
    assert [name for name, _, _ in lanes(head)[0]] == ["a-rdm"]


def test_write_targets_allow_the_read_of_an_emulated_write():
    """An EFA device with RDMA read and no RDMA write emulates a large WRITE with a READ into
    the target (efa_rdm_pke_rtw.c); efa_mr.c grants that local write only for access beyond
    FI_SEND/FI_RECV/FI_REMOTE_READ/FI_REMOTE_WRITE. Every target registers WRITE_TARGET."""
    assert memory.WRITE_TARGET == lib.FI_REMOTE_WRITE | lib.FI_READ
    bare = re.compile(r"register\([^)]*lib\.FI_REMOTE_WRITE\s*,")
    sources = sorted((ROOT / "chapters").glob("*.py")) + sorted((ROOT / "common").rglob("*.py"))
    assert [p.name for p in sources if bare.search(p.read_text())] == []
    uses = [str(p.relative_to(ROOT)) for p in sources if "memory.WRITE_TARGET" in p.read_text()]
    assert uses == ["chapters/06_write.py", "chapters/07_queue.py", "common/engine/multinet.py",
                    "common/moe/proxy.py", "common/transfer/engine.py"]

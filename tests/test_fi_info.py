"""How we ask for and use fi_info on real NICs (efa, verbs), checked without one: the
fabric, the modes, FI_HMEM, CQ room, lanes of one kind, access, efa's shm path."""
import argparse
import re
from pathlib import Path

import pytest

from common import cli, memory, multinet
import common.fabric as fi
from common.fabric import lib
from tests import fake_info
from tests.fake_info import Entry

ROOT = Path(__file__).resolve().parent.parent


def test_efa_hints_name_the_rdm_fabric_and_no_mode():
    """efa-direct (listed first from 2.1) needs FI_CONTEXT2 and follows other rules: we ask
    for the RDM fabric by name and offer no mode, FI_RX_CQ_DATA included."""
    efa = fi.hints("efa", caps=lib.FI_MSG | lib.FI_RMA)
    assert fi.string(efa.fabric_attr.name) == "efa"
    assert efa.mode == 0
    assert fi.hints("shm").fabric_attr.name == fi.ffi.NULL  # one fabric: nothing to choose


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
    return fake_info.infos(Entry("rdmap79s0-rdm", pci="0000:4f:00.0", gbps=100))


def test_gpu_memory_without_fi_hmem_stops_with_the_cause(monkeypatch):
    """A provider that refuses FI_HMEM (efa: no CUDA, P2P off, FI_EFA_USE_DEVICE_RDMA=0)
    must not hand back a list that would register GPU memory as host memory."""
    head = efa_list()

    def getinfo(hint):
        if hint.caps & lib.FI_HMEM:
            raise fi.FabricError("fi_getinfo", -lib.FI_ENODATA)
        return head
    monkeypatch.setattr(fi, "getinfo", getinfo)
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
    monkeypatch.setattr(fi, "cq_open", lambda domain, size: sizes.append(size) or
                        cq_open(domain, size))
    info, _ = fi.pick(provider, multinet.CAPS)
    with fi.Closer() as own:
        lane = multinet.Lane(own, info)
    assert len(lane.queue.busy) == fi.in_flight(info) >= 4 * info.tx_attr.size
    assert sizes == [fi.cq_size_for(info)] == [len(lane.queue.busy) + info.rx_attr.size]
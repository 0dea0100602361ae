"""-p efa-direct: efa's fabric of the device alone, as fi_info names it (common/fabric
NAMED_FABRICS): the hints that pick it, the name a chapter prints for it, one line where
this host has none, and the AVs of 09-15's client, which must hold the server's lanes."""
import argparse
import subprocess
import sys

import pytest

import common.fabric as fi
from common import cli
from common.fabric import lib
from common.chapter_pair import ADDRESS, ROOT, chapter_path, local_env
from tests.support import fake_info
from tests.support.budget import Budget
from tests.support.chapter_procs import start
from tests.support.one_line_errors import assert_one_line_error
from tests.support.rules import AV, SMALL


def test_hints_name_the_provider_and_the_fabric_and_offer_fi_context2():
    hint = fi.hints("efa-direct", caps=lib.FI_MSG | lib.FI_RMA)
    assert fi.string(hint.fabric_attr.prov_name) == "efa"
    assert fi.string(hint.fabric_attr.name) == "efa-direct"
    assert hint.mode & lib.FI_CONTEXT2  # or fi_getinfo drops it (prov/util/src/util_attr.c)
    rdm = fi.hints("efa")
    assert fi.string(rdm.fabric_attr.name) == "efa" and not rdm.mode & lib.FI_CONTEXT2


def test_a_chapter_prints_the_name_that_picks_its_fabric(monkeypatch, capsys):
    """The client command a server prints says -p efa-direct, not -p efa."""
    head = fake_info.infos(fake_info.Entry("rdmap79s0-rdm", fabric="efa-direct"),
                           fake_info.Entry("rdmap79s0-rdm", fabric="efa"))
    assert [fi.name_of(i) for i in fi.each(head)] == ["efa-direct", "efa"]
    monkeypatch.setattr(fi, "pick", lambda provider, caps, hmem: (head, "asked for"))
    args = argparse.Namespace(provider="efa-direct")
    cli.pick_provider(args)
    assert args.provider_used == "efa-direct"
    assert "fabric efa-direct" in capsys.readouterr().out
    assert fi.name_of(fake_info.infos(fake_info.Entry("x", provider="verbs;ofi_rxm"))) == "verbs"


def efa_by_fabric(monkeypatch):
    """fi.getinfo as efa >= 2.1 answers: each fabric's entry for the fabric the hints name,
    efa-direct's only for hints with FI_CONTEXT2 (prov/efa/src/efa_user_info.c); both
    with FI_HMEM when asked (a GPU host whose NIC reaches its memory). Returns the hints
    asked with."""
    asked = []

    def getinfo(hint, flags=0):
        asked.append((fi.string(hint.fabric_attr.name), hint.caps, hint.mode))
        fabric = fi.string(hint.fabric_attr.name)
        if fabric == "efa-direct" and not hint.mode & lib.FI_CONTEXT2:
            raise fi.FabricError("fi_getinfo", -lib.FI_ENODATA)
        return fake_info.infos(fake_info.Entry("rdmap79s0-rdm", fabric=fabric,
                                               caps=hint.caps))
    fake_info.patch(monkeypatch, "getinfo", getinfo)
    return asked


@pytest.mark.parametrize("name", ["efa-direct", "efa"])
def test_gpu_memory_keeps_the_fabric_asked_for(monkeypatch, name):
    """-p efa-direct --gpu: asking again with FI_HMEM keeps efa-direct (its fabric name and
    FI_CONTEXT2), not efa's RDM fabric of the same provider name."""
    asked = efa_by_fabric(monkeypatch)
    info, _ = fi.pick(name, lib.FI_MSG | lib.FI_RMA, hmem=True)
    assert fi.name_of(info) == name and info.caps & lib.FI_HMEM
    fabric, caps, mode = asked[-1]
    assert fabric == name and caps & lib.FI_HMEM
    assert bool(mode & lib.FI_CONTEXT2) == (name == "efa-direct")


def test_efa_direct_without_fi_hmem_says_efas_causes(monkeypatch):
    efa_by_fabric(monkeypatch)
    listed = fi.getinfo

    def getinfo(hint, flags=0):
        if hint.caps & lib.FI_HMEM:
            raise fi.FabricError("fi_getinfo", -lib.FI_ENODATA)
        return listed(hint, flags)
    fake_info.patch(monkeypatch, "getinfo", getinfo)
    with pytest.raises(ValueError, match=r"^efa-direct offers no FI_HMEM here, .*"
                                         r"FI_EFA_USE_DEVICE_RDMA"):
        fi.pick("efa-direct", lib.FI_MSG | lib.FI_RMA, hmem=True)


@pytest.mark.long
def test_no_efa_direct_here_is_one_line():
    """09-15 too: they follow it (tests/test_fabric_rules.py runs them under its rules)."""
    for chapter in (4, 6, 9, 14):
        done = subprocess.run([sys.executable, str(chapter_path(chapter)), "-p", "efa-direct"],
                              capture_output=True, text=True, env=local_env({}), timeout=60)
        assert_one_line_error(done, "provider 'efa-direct' has no usable device here")
        assert "efa-direct needs an EFA device and libfabric >= 2.1" in done.stderr


# A chapter's client that answers the server's lane addresses without putting them in its
# lanes' AVs: what efa-direct's device would drop the WRITEs of (common/engine/multinet.py).
CARELESS = """\
import runpy, sys
from common.engine import multinet

def careless(own, control, inbox, lanes, server, timeout):
    _, length = control.poller.wait([inbox.ctx], timeout, "lane addresses from the server")
    inbox.take(length)
    control.poller.send(own, control.domain, control.ep, multinet.INSERTED, server, 1004,
                        timeout, "word of the lanes in our AVs")

multinet.insert_lanes = careless
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.long
@pytest.mark.parametrize("chapter", [9, 14])
def test_a_client_that_skips_the_lanes_in_its_avs_breaks_the_rule(chapter, provider,
                                                                   monkeypatch):
    """FABRIC_RULES=efa-direct sees it where the first immediate lands; the real client,
    which inserts them, keeps the rule (tests/test_fabric_rules.py)."""
    monkeypatch.setenv("FABRIC_RULES", "efa-direct")
    budget = Budget(90)
    server, out = start(chapter, ["-p", provider, "--clients", "1",
                                  "--timeout", f"{budget.grant(5):g}"], ADDRESS.pattern)
    try:
        client = budget.run([sys.executable, "-c", CARELESS, str(chapter_path(chapter)),
                             "-p", provider, ADDRESS.search(out)[1], "--groups", "2",
                             "--nics-per-gpu", "2", *SMALL], env=local_env(), cwd=ROOT)
        budget.communicate(server)
    finally:
        server.kill()
    assert_one_line_error(client, AV)
    assert server.returncode == 0  # --clients 1: a client that failed was served too

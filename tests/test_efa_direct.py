"""-p efa-direct: efa's fabric of the device alone, as fi_info names it (common/fabric
NAMED_FABRICS): the hints that pick it, the name a chapter prints for it, and one line where
this host has none."""
import argparse
import subprocess
import sys

import common.fabric as fi
from common import cli
from common.fabric import lib
from scripts.pair import chapter_path, local_env
from tests import fake_info
from tests.test_bad_input import assert_one_line_error


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


def test_chapters_09_to_15_refuse_it_in_one_line():
    """Their client never inserts the server's NICs: efa-direct's device would drop the
    WRITEs (tests/test_rules.py shows the rule caught in their runs)."""
    for chapter in (9, 14):
        done = subprocess.run([sys.executable, str(chapter_path(chapter)), "-p", "efa-direct"],
                              capture_output=True, text=True, env=local_env({}), timeout=60)
        assert_one_line_error(done, "-p efa-direct: chapters 09-15 cannot follow it")
        assert done.returncode == 2


def test_no_efa_direct_here_is_one_line():
    for chapter in (4, 6):
        done = subprocess.run([sys.executable, str(chapter_path(chapter)), "-p", "efa-direct"],
                              capture_output=True, text=True, env=local_env({}), timeout=60)
        assert_one_line_error(done, "provider 'efa-direct' has no usable device here")
        assert "efa-direct needs an EFA device and libfabric >= 2.1" in done.stderr

"""FI_MORE (issue 46, 6 and "FI_MORE by version and fabric"): efa-direct's send queue bounds a
batch, FABRIC_RULES=efa-direct holds shm to that, and chapter 14 uses FI_MORE only where the
libfabric it runs on is known to ring the doorbell of what it holds.

On efa-direct's rdma-core path (FI_EFA_USE_DATA_PATH_DIRECT=0, or a build or device without
the direct path) a post with FI_MORE returns 0 without a look at the send queue, and the
closing post's ibv_wr_complete refuses the whole batch when the queue is full, rolling it
back: WRITEs already answered 0 never happen (prov/efa/src/efa_data_path_ops.h
efa_ibv_post_write). tests/test_11_15_native_workers.py shows chapter 14's lane on a fake
of that path; here the rule and the chapter under it.
"""
import subprocess
import sys

import pytest

import common.fabric as fi
from common.chapter_pair import ROOT, chapter_module, local_env, run_pair
from tests.support import fake_info
from tests.support.one_line_errors import assert_one_line_error
from tests.support.rules import SMALL, program as rules_program

ROOM = "rules of efa-direct: a batch with FI_MORE past the send queue's room"
SQ = "4"  # FI_SHM_TX_SIZE: shm's tx_attr.size, the send queue the rule holds a batch to


def batch(n, rules):
    """`n` WRITEs, all but the last with FI_MORE, on an endpoint whose tx_attr.size is SQ."""
    body = ("for i in range(%d):\n"
            "    poller.until_posted(lambda: fi.writemsg(ep, src.ptr, 64, desc, me, base, key, "
            "ctx + i, flags=lib.FI_COMPLETION | (lib.FI_MORE if i < %d else 0)), 10, "
            "'the WRITE')\n"
            "assert info.tx_attr.size == %s, info.tx_attr.size\n"
            "poller.wait_all([ctx + i for i in range(%d)], 10, 'the WRITEs')") % (n, n - 1, SQ, n)
    program = rules_program(body)
    extra = {"FI_SHM_TX_SIZE": SQ, **({"FABRIC_RULES": rules} if rules else {})}
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=local_env(extra), timeout=30, cwd=ROOT)


def test_a_batch_past_the_send_queue_is_refused():
    assert_one_line_error(batch(5, "efa-direct"), ROOM)


@pytest.mark.parametrize("n,rules", [(4, "efa-direct"), (5, "efa"), (5, "verbs"), (5, None)])
def test_a_batch_within_the_send_queue_passes(n, rules):
    """4 fill the queue and pass; efa's RDM fabric keeps its own count of what it posts
    (rdm/efa_rdm_ope.c: efa_outstanding_tx_ops), verbs and shm take more."""
    done = batch(n, rules)
    assert done.returncode == 0, done.stderr


@pytest.mark.long
def test_14_keeps_efa_directs_send_queue():
    """Chapter 14 under efa-direct's rules, on shm with a send queue of SQ WRITEs: its
    batches of 16 fit the room left, or go without FI_MORE."""
    pair = run_pair(14, "shm", ["--clients", "1"], [["--nics-per-gpu", "2", *SMALL]],
                    env={"FABRIC_RULES": "efa-direct", "FI_SHM_TX_SIZE": SQ})
    assert pair.ok and not pair.stopped, pair
    assert "0 wrong bytes" in "".join(c.out for c in pair.clients), pair


# --- where chapter 14 uses FI_MORE: by fabric and libfabric version -----------------------

@pytest.mark.parametrize("fabric,provider,version,on", [
    ("efa", "efa", (2, 6), False),         # replays a WRITE it queued with FI_MORE: a hang
    ("efa", "efa", (2, 4), False),         # 2.4.x's backport: fi_version() has no patch level
    ("efa", "efa", (2, 7), True),          # main 3b01e1417
    ("efa-direct", "efa", (2, 1), True),   # within the send queue's room (the lane sees to it)
    ("efa-direct", "efa", (2, 6), True),
    ("shm", "shm", (1, 17), True),         # a hint shm, tcp and verbs pass over
    ("tcp", "tcp", (2, 6), True),
    ("IB-0xfe80000000000000", "verbs;ofi_rxm", (2, 6), True),
])
def test_14_uses_fi_more_where_it_is_safe(monkeypatch, fabric, provider, version, on):
    chapter = chapter_module(14)
    monkeypatch.setattr(fi, "version", lambda: version)
    head = fake_info.infos(fake_info.Entry("d", fabric=fabric, provider=provider))
    more, why = chapter.more_flag(head)
    assert more == (fi.lib.FI_MORE if on else 0)
    assert ("FI_MORE off" in why) != on, why

"""Chapter 07: many WRITEs through the pending queue, each completed exactly once,
every byte checked."""
import json
import re
import shlex
import signal

import pytest

import common.fabric as fi
import common.engine.opqueue as queue_module
import common.fabric.poller as poller_module
from common.chapter_pair import chapter_module, run_pair
from tests.support.chapter_procs import SMALL, client_gone_server_survives, fault_then_next_client
from tests.support.gpu import has_gpu, needs_gpu
from tests.support.one_line_errors import SHM_DEAD, assert_one_line_error, run

# Provider queues made tiny, so that fi_writemsg says -FI_EAGAIN again and again.
# shm without CMA copies through a handful of bounce buffers, which run out at
# once (with CMA a quick reader may keep up). tcp is "tcp;ofi_rxm" in libfabric
# 1.x, whose queue is rxm's; 2.x's own tcp RDM endpoint queues without limit
# and never says -FI_EAGAIN, whatever its settings.
TINY_QUEUES = {"shm": {"FI_SHM_RX_SIZE": "8", "FI_SHM_TX_SIZE": "8", "FI_SHM_DISABLE_CMA": "1"},
               "tcp": {"FI_TCP_TX_SIZE": "8", "FI_OFI_RXM_TX_SIZE": "8"}}
EAGAIN_FORCED = {"shm": True, "tcp": fi.version() < (2, 0)}


def completions(server_out):
    m = re.search(r"completions: (\d+), one per WRITE; -FI_EAGAIN (\d+) times", server_out)
    assert m, server_out
    return int(m[1]), int(m[2])


def test_07_every_page_arrives(provider):
    pair = run_pair(7, provider, ["--clients", "1"], [["--iters", "3000", *SMALL]])
    assert pair.ok and not pair.stopped, pair
    out = pair.clients[0].out
    assert "FI_REMOTE_CQ_DATA, immediate data 3000" in out
    assert "verified 64 pages (4194304 bytes): 0 wrong bytes" in out
    assert completions(pair.server.out)[0] == 3000
    assert re.search(r"3000 WRITEs of 65536 bytes in [\d.]+ s: [\d.]+ Gbps, [\d.]+ Mpps",
                     pair.server.out)


@pytest.mark.long
def test_07_eagain_is_queued_never_lost(provider):
    # Many more WRITEs than the provider's queue holds: most wait in our queue.
    pair = run_pair(7, provider, ["--clients", "1"], [["--iters", "2000", *SMALL]],
                    env=TINY_QUEUES[provider])
    assert pair.ok, pair
    done, eagain = completions(pair.server.out)
    assert done == 2000
    assert eagain > 0 or not EAGAIN_FORCED[provider]
    assert "verified 64 pages (4194304 bytes): 0 wrong bytes" in pair.clients[0].out


@pytest.mark.long
def test_07_lesson_run_is_refused_on_shm_every_time():
    """The run the tour judges 07 by (LESSON's client) meets -FI_EAGAIN on shm whatever
    CPU the client gets. It asks --delivery-complete: the server posts each WRITE with
    FI_DELIVERY_COMPLETE, which keeps it off the path that copies within fi_writemsg
    (smr_rma_fast) and holds one of the server's slots, tx_attr.size rounded up to a power
    of two, until a read of the server's CQ takes the client's answer (1.17, 2.1:
    smr_do_iov, smr_progress_resp; 2.6: smr_cmd_stack, smr_progress_return). write_all
    reads the CQ only once posts wait in its queue, and has four times tx_attr.size
    contexts (fi.in_flight): the first burst of a run of more than twice tx_attr.size
    WRITEs is refused once those slots are gone."""
    ch = chapter_module(7)
    flags = shlex.split(ch.LESSON["client"])
    iters = int(flags[flags.index("--iters") + 1])
    info, _ = fi.pick("shm", ch.CAPS)
    assert "--delivery-complete" in flags and iters > 2 * info.tx_attr.size
    assert fi.in_flight(info) > 2 * info.tx_attr.size
    pair = run_pair(7, "shm", ["--clients", "1"], [flags])
    assert pair.ok, pair
    done, eagain = completions(pair.server.out)
    assert done == iters and eagain > 0, pair.server.out
    assert re.search(r"verified 64 pages \(\d+ bytes\): 0 wrong bytes", pair.clients[0].out)


@pytest.mark.long
def test_07_default_pages_and_odd_sizes(provider):
    # No --pages: the first 1000 pages of each buffer (here all 3 of each).
    pair = run_pair(7, provider, ["--clients", "1"],
                    [["--iters", "50", "--page-size", "1000", "--buffer-size", "3000"]])
    assert pair.ok, pair
    assert "verified 6 pages (6000 bytes): 0 wrong bytes" in pair.clients[0].out


@pytest.mark.long
def test_07_json_record(tmp_path):
    out = tmp_path / "run.json"
    pair = run_pair(7, "shm", ["--clients", "1", "--json", str(out)],
                    [["--iters", "500", *SMALL]])
    assert pair.ok, pair
    record = json.loads(out.read_text())
    assert record["chapter"] == "07_queue" and record["provider"] == "shm"
    assert record["ops"] == 500 and record["bytes"] == 500 * 65536
    assert record["gbps"] > 0 and record["memory"] == "host"
    assert re.fullmatch(r"\d+\.\d+", record["libfabric"])
    for key in ("machine", "git", "server_args", "client_args", "mpps", "elapsed_s", "limit"):
        assert key in record
    assert record["lesson"] == "refused" and record["refused"] >= 0
    assert record["client_args"]["iters"] == 500 and record["server_args"]["json"] == "run.json"
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.long
def test_07_wrong_key_is_reported_and_server_survives():
    pair = run_pair(7, "shm", ["--clients", "2", "--timeout", "3"],
                    [["--bad-key", "--iters", "500", "--timeout", "5", *SMALL],
                     ["--iters", "500", *SMALL]], keep_going=True)
    assert pair.clients[0].rc == 1 and "Traceback" not in pair.clients[0].err
    assert re.search(r"^client 1: failed: ", pair.server.err, re.MULTILINE), pair.server.err
    assert pair.server.rc == 0, pair
    assert "verified 64 pages (4194304 bytes): 0 wrong bytes" in pair.clients[1].out


class FakeEntry:
    def __init__(self, context):
        self.op_context, self.flags, self.len, self.data = context, 0, 0, 0


def test_07_a_second_completion_is_caught(monkeypatch):
    """The queue's bookkeeping, without a provider: posts that say EAGAIN wait in
    order; a completion for a context not in flight is an error, not a count."""
    ch = chapter_module(7)
    posted, answers, cq = [], iter([0, -ch.lib.FI_EAGAIN, 0, 0]), []

    def writemsg(ep, msg, flags):
        rc = next(answers)
        if rc == 0:
            posted.append(msg.context)
        return rc

    def cq_read(_, entries):
        entries[:] = cq
        n = len(cq)
        cq.clear()
        return n

    monkeypatch.setattr(queue_module, "lib", type("Lib", (), {
        "fi_writemsg": staticmethod(writemsg), "FI_EAGAIN": ch.lib.FI_EAGAIN,
        "FI_COMPLETION": ch.lib.FI_COMPLETION,
        "FI_DELIVERY_COMPLETE": ch.lib.FI_DELIVERY_COMPLETE}))
    monkeypatch.setattr(poller_module, "cq_read", cq_read)
    monkeypatch.setattr(ch.fi, "cq_entries", lambda n: [])
    messages = queue_module.ffi.new("struct fi_msg_rma[]", 3)
    queue = ch.OpQueue(None, None, fi.Poller(None), slots=4)
    for page in range(3):
        queue.write(messages + page)
    assert len(posted) == 1 and queue.eagain == 1
    assert [m for _, m, _ in queue.pending] == [messages + 1, messages + 2]
    cq.append(FakeEntry(posted[0]))
    assert queue.progress() == 1 and not queue.pending and len(posted) == 3
    assert queue.completed == 1 and queue.in_flight() == 2
    cq.append(FakeEntry(posted[0]))  # the first WRITE again: it is no longer in flight
    with pytest.raises(ValueError, match="second completion"):
        queue.progress()


def test_07_our_full_queue_is_not_counted_as_the_providers(monkeypatch):
    """A post held back because all our contexts are in flight is no -FI_EAGAIN."""
    ch = chapter_module(7)
    monkeypatch.setattr(queue_module, "lib", type("Lib", (), {
        "fi_writemsg": staticmethod(lambda ep, msg, flags: 0), "FI_EAGAIN": ch.lib.FI_EAGAIN,
        "FI_COMPLETION": ch.lib.FI_COMPLETION,
        "FI_DELIVERY_COMPLETE": ch.lib.FI_DELIVERY_COMPLETE}))
    messages = queue_module.ffi.new("struct fi_msg_rma[]", 2)
    queue = ch.OpQueue(None, None, None, slots=1)
    queue.write(messages + 0)
    queue.write(messages + 1)
    assert (queue.eagain, queue.full, len(queue.pending)) == (0, 1, 1)


def test_07_drain_empties_the_cq_of_errors_without_a_context(monkeypatch):
    """shm from libfabric 2.5 leaves an error entry with no context for every failed post
    to a gone peer: after a failure the queue reads them all, so that the server's wait
    for its next client does not meet them."""
    ch = chapter_module(7)
    reads = ["error", "error"]  # two errors without a context, then an empty CQ

    def cq_read(_, entries):
        if reads:
            reads.pop(0)
            raise ch.fi.CompletionError(-5, "Input/output error", queue_module.ffi.NULL)
        return 0

    monkeypatch.setattr(poller_module, "cq_read", cq_read)
    monkeypatch.setattr(ch.fi, "cq_entries", lambda n: [])
    queue = ch.OpQueue(None, None, fi.Poller(None), slots=4)
    queue.drain(5)
    assert not reads


@pytest.mark.long
@pytest.mark.parametrize("args,pattern", [
    (["--page-size", "0"], "0 < page size"),
    (["--page-size", "1.5K"], "not a size"),
    (["--page-size", "2G"], "<= buffer size"),
    (["--pages", "40000"], "--pages must name pages 0..32767"),
    (["--pages", "a-b"], "not a page number"),
    (["--iters", "0"], "--iters must be"),
    (["--page-size", "4K", "--pages", ",".join(map(str, range(0, 2000, 2)))], "too many pages"),
    (["--gpu", "0"] if not has_gpu() else ["--gpu", "99"], "GPU"),
])
def test_07_bad_input(args, pattern):
    done, _ = run(7, "-p", "shm", SHM_DEAD, *args)
    assert_one_line_error(done, pattern)


@needs_gpu
def test_07_gpu_buffers():
    pair = run_pair(7, "shm", ["--clients", "1", "--gpu", "0"],
                    [["--gpu", "0", "--page-size", "1M", "--buffer-size", "16M", "--pages", "0-15",
                      "--iters", "200"]])
    assert pair.ok, pair
    assert "GPU 0 memory" in pair.clients[0].out
    assert "verified 16 pages (16777216 bytes): 0 wrong bytes" in pair.clients[0].out
    assert completions(pair.server.out)[0] == 200


def test_07_client_gone_mid_run_server_survives(provider):
    client_gone_server_survives(7, provider)


def test_07_client_frozen_mid_run_next_is_served(provider):
    """A client frozen (SIGSTOP) while WRITEs stream into it, and the next client started
    at once, as a person would: the server says the first failed, in one line, and serves
    the next. On rxm (1.x's tcp) the frozen client's WRITEs hold every tx credit of the
    server's endpoint, so the server opens a new endpoint at the same address
    (07_queue.lends_credits); before that, the next client's WRITEs waited in vain."""
    err, _ = fault_then_next_client(7, provider, signal.SIGSTOP, 3)
    assert re.search(r"^client 1: failed: ", err, re.MULTILINE), err

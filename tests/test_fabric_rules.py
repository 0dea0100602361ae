"""FABRIC_RULES=efa|efa-direct|verbs (common/fabric/rules.py, common/fabric/rules.h): chapters
04-16, 18 and 19 on shm and tcp (18 and 19 under efa and efa-direct), checked as an EFA
device (through either fabric) or a verbs NIC would check them; and each rule, broken on
purpose, caught (where shm alone lets the same call through).

The runs of the chapters once broke efa's rules on two findings of issue 15: CQs of 64
entries with up to 4 x tx_size WRITEs in flight (1b) and CONNECTs above the MTU (2).
"""
import re
import subprocess
import sys

import pytest

from common.chapter_pair import ROOT, chapter_path, local_env, run_pair
import common.fabric as fi
from common.fabric import lib
from tests.support.one_line_errors import assert_one_line_error
from tests.support.rules import AV, SMALL, program as rules_program

RULES = ["efa", "efa-direct", "verbs"]
EFA = ["efa", "efa-direct"]  # the rules of the device, whichever fabric drives it
# Enough WRITEs for 09-14 that their overrun of a 64-entry CQ shows in every run here
# (with SMALL's 3001, a run of chapter 10 missed it about once in ten)
MANY = ["--buffer-size", "4M", "--pages", "0-63", "--iters", "12001"]
CQ = "more operations in flight than the CQ has entries"  # words of two of efa's rules
CONNECT = "a SEND larger than the 8928-byte EFA MTU"
HINTS = "hints without mode FI_CONTEXT2 or mr_mode FI_MR_LOCAL, FI_MR_ALLOCATED"
MORE = "the CQ read with a batch left open"
# Where the loaded libfabric's EFA CQs take wait objects (efa_cq.c, rdm/efa_rdm_cq.c; NEWS.md:
# efa-direct's blocking CQ read came in 2.3, efa's in 2.5)
WAITS = [rules for rules, since in (("efa", (2, 5)), ("efa-direct", (2, 3)))
         if fi.version() >= since]
WAIT = "a CQ wait object this libfabric's EFA CQs refuse"
OTHER_WAIT = "a CQ wait object other than FI_WAIT_UNSPEC or FI_WAIT_FD"


def env(rules):
    return {"FABRIC_RULES": rules}


# (id, chapter, server args, each client's args)
PAIRS = [
    ("04", 4, [], [["hello"]]),
    ("05", 5, ["--clients", "2"], [["hello"], ["libfabric"]]),
    ("06", 6, ["--clients", "1"], [["--pages", "0,3,5-9"]]),
    ("07", 7, ["--clients", "1"], [SMALL]),
    # 3 buffers of 1000 pages: a CONNECT of about 12 KB in the old format
    ("07-3-buffers", 7, ["--clients", "1"],
     [["--buffers", "3", "--page-size", "4K", "--buffer-size", "4M", "--iters", "3000"]]),
] + [
    (name, chapter, ["--clients", "1", *server],
     [["--groups", "2", "--nics-per-gpu", "2", *(SMALL if chapter == 15 else MANY)]])
    for name, chapter, server in [("09", 9, []), ("10", 10, []),
                                  ("11c", 11, ["--engine", "native"]),
                                  ("11py", 11, ["--engine", "python"]), ("12", 12, []),
                                  ("13", 13, []), ("14", 14, []), ("15", 15, [])]]


@pytest.mark.long
@pytest.mark.parametrize("rules,chapter,server_args,client_args",
                         [pytest.param(rules, *case[1:], id=f"{rules}-{case[0]}")
                          for rules in RULES for case in PAIRS])
def test_chapter_keeps_the_rules(rules, chapter, server_args, client_args, provider):
    pair = run_pair(chapter, provider, server_args, client_args, env=env(rules))
    assert pair.ok and not pair.stopped, pair
    out = "".join(c.out for c in pair.clients)
    if chapter >= 6:
        assert re.search(r"verified .*: 0 wrong bytes", out), pair
    if chapter in (6, 7):  # the rules leave FI_MR_VIRT_ADDR out: offsets, checked above
        assert "memory registration: no mode bits" in out, out


@pytest.mark.long
def test_p5_layout_connect_fits_the_mtu():
    """09 with the p5's 8 GPUs x 4 NICs and the default 1000 pages per buffer: a CONNECT
    of about 10.7 KB in the old format, within efa's MTU now."""
    pair = run_pair(9, "shm", ["--clients", "1"],
                    [["--groups", "8", "--nics-per-gpu", "4", "--page-size", "4K",
                      "--buffer-size", "4M", "--iters", "16000"]], env=env("efa"))
    assert "8 x 4 virtual NICs" in pair.server.out, pair  # the server took the CONNECT
    assert pair.ok and not pair.stopped, pair


@pytest.mark.long
@pytest.mark.parametrize("rules", RULES)
def test_08_keeps_the_rules(rules, provider):
    done = subprocess.run([sys.executable, str(chapter_path(8)), "-p", provider],
                          capture_output=True, text=True, env=local_env(env(rules)), timeout=60)
    assert done.returncode == 0 and "NICs: 0" in done.stdout, done.stderr


@pytest.mark.long
@pytest.mark.parametrize("rules", RULES)
def test_16_across_two_nodes_keeps_the_rules(rules, provider):
    """Two emulated nodes: every dispatch and combine goes through the C proxy."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "-n", "2", "--ranks-per-node", "1",
         str(chapter_path(16)), "-p", provider, "--max-tokens", "6", "--hidden", "128",
         "--experts", "16", "--topk", "3", "--private-tokens", "2", "--iters", "0"],
        capture_output=True, text=True, env=local_env(env(rules)), timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "[0] all checks passed" in done.stdout, done.stderr


@pytest.mark.long
@pytest.mark.parametrize("rules", EFA)
def test_18_keeps_the_rules_of_an_efa_device(rules, provider):
    """The transfer engine's C worker and control messages, a KV cache handed over."""
    small = ["--tokens", "512", "--layers", "8"]
    pair = run_pair(18, provider, small, [small], env=env(rules))
    assert pair.ok and not pair.stopped, pair
    assert "checked 64 pages and the context: 0 wrong bytes" in pair.server.out, pair


@pytest.mark.long
@pytest.mark.parametrize("rules", EFA)
def test_19_keeps_the_rules_of_an_efa_device(rules, provider):
    """Trainers' shards into inference ranks' weights by the engine's WRITE lists."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "-n", "4", str(chapter_path(19)),
         "-p", provider, "--model", "tiny"],
        capture_output=True, text=True, env=local_env(env(rules)), timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert len(re.findall(r"^\[0\] .*: 0 wrong bytes", done.stdout, re.M)) >= 2, done.stdout


# --- each rule, broken on purpose (tests/support/rules.py program) ----------------------------

WAITING = ("attr = ffi.new('struct fi_cq_attr *', {{'size': 8, 'format': lib.FI_CQ_FORMAT_DATA, "
           "'wait_obj': lib.{wait}}})\n"
           "waiting = ffi.new('struct fid_cq **')\n"
           "fi.check('fi_cq_open', lib.fi_cq_open(domain, attr, waiting, ffi.NULL))\n"
           "fi.close(waiting[0])")

BROKEN = {  # rule: (what breaks it, the error line's words, rule sets that have it)
    "descriptor": ("write(desc=ffi.NULL)", "FI_MR_LOCAL: a buffer without a descriptor", RULES),
    "descriptor of another buffer": (
        "fi.recvmsg(ep, src.ptr, 64, fi.mr_desc(dst_mr), lib.FI_ADDR_UNSPEC, ctx)",
        "FI_MR_LOCAL: a buffer outside the registration", RULES),
    "closed registration": (
        "mr = fi.mr_reg(domain, src.ptr, 64, lib.FI_SEND, key=3)\n"
        "gone = fi.mr_desc(mr)\nfi.close(mr)\nwrite(desc=gone)",
        "FI_MR_LOCAL: the descriptor of a closed registration", RULES),
    "requested key": ("write(key=2)", "FI_MR_PROV_KEY: a WRITE with a key fi_mr_key did not "
                      "return", RULES),
    "9000-byte SEND": (
        "assert fi.recvmsg(ep, dst.ptr, 9000, fi.mr_desc(dst_mr), lib.FI_ADDR_UNSPEC, ctx + 1)\n"
        "poller.until_posted(lambda: fi.sendmsg(ep, src.ptr, 9000, desc, me, ctx), 10, "
        "'the SEND')", CONNECT, EFA),
    "immediate above 32 bits": ("write(data=1 << 32)", "immediate data above 32 bits", RULES),
    "two rma_iovs": (
        "iov = ffi.new('struct iovec *', {'iov_base': ffi.cast('void *', src.ptr), "
        "'iov_len': 64})\n"
        "rma = ffi.new('struct fi_rma_iov[2]', [{'addr': base, 'len': 32, 'key': key}] * 2)\n"
        "descs = ffi.new('void *[1]', [desc])  # kept: a struct does not own what it points to\n"
        "msg = ffi.new('struct fi_msg_rma *', {'msg_iov': iov, 'desc': descs, 'iov_count': 1, "
        "'addr': me, 'rma_iov': rma, 'rma_iov_count': 2, 'context': ctx})\n"
        "poller.until_posted(lambda: fi.posted('fi_writemsg', lib.fi_writemsg(ep, msg, "
        "lib.FI_COMPLETION)), 10, 'the WRITE')",
        "more than one rma_iov", RULES),
    "too small a CQ": ("for i in range(9):\n"
                       "    assert fi.recvmsg(ep, dst.ptr, 64, fi.mr_desc(dst_mr), "
                       "lib.FI_ADDR_UNSPEC, ctx + i % 8)", CQ, EFA),
    # issue 46, 7: a peer's WRITEs with an immediate fill our CQ too
    "too small a CQ for a peer's immediates": (
        "tdomain, tcq, tav, tep = fi.open_endpoint(own, info, cq_size=4)\n"
        "fi.av_insert(tav, fi.getname(ep))\n"
        "tdst = memory.Buffer(1 << 16)\n"
        "tkey = fi.mr_key(memory.register(own, tdomain, tdst, lib.FI_REMOTE_WRITE, key=7))\n"
        "target, tpoller = fi.av_insert(av, fi.getname(tep)), fi.Poller(tcq)\n"
        "poller.until_posted(lambda: tpoller.poll() >= 0 and fi.writemsg(ep, src.ptr, 64, "
        "desc, target, fi.remote_base(info, tdst.ptr), tkey, ctx + 7, data=9), 10, 'the WRITE')\n"
        "tpoller.wait_remote_data(10, 'the first immediate')  # shm has met its peer\n"
        "for i in range(7):\n"
        "    poller.until_posted(lambda: fi.writemsg(ep, src.ptr, 64, desc, target, "
        "fi.remote_base(info, tdst.ptr), tkey, ctx + i, data=i), 10, 'the WRITE')\n"
        "tpoller.wait_remote_data(10, 'the immediates')",
        CQ + " (peers' immediates not read yet counted)", EFA),
    "wait object": (WAITING.format(wait="FI_WAIT_UNSPEC"), WAIT,
                    [rules for rules in EFA if rules not in WAITS]),
    # efa's shm path (on unless FI_EFA_ENABLE_SHM_TRANSFER=0) has no fd to wait on
    # (rdm/efa_rdm_cq.c, efa_rdm_cq_configure_wait)
    "fd wait object": (
        WAITING.format(wait="FI_WAIT_FD"), WAIT,
        [rules for rules in EFA if rules == "efa" or rules not in WAITS]),
    # efa-direct: what one work request per call demands
    "hints without FI_CONTEXT2": ("hint = fi.hints('shm')\nhint.mode = 0\nfi.getinfo(hint)",
                                  HINTS, ["efa-direct"]),
    "hints without FI_MR_LOCAL": (
        "hint = fi.hints('shm')\nhint.domain_attr.mr_mode &= ~lib.FI_MR_LOCAL\nfi.getinfo(hint)",
        HINTS, ["efa-direct"]),
    "no context": ("poller.until_posted(lambda: fi.writemsg(ep, src.ptr, 64, desc, me, base, "
                   "key, ffi.NULL), 10, 'the WRITE')",
                   "an operation without a context (FI_CONTEXT2", ["efa-direct"]),
    "three buffers in a SEND": (
        "assert fi.recvmsg(ep, dst.ptr, 192, fi.mr_desc(dst_mr), lib.FI_ADDR_UNSPEC, ctx + 1)\n"
        "iov = ffi.new('struct iovec[3]', [{'iov_base': ffi.cast('void *', src.ptr + 64 * i), "
        "'iov_len': 64} for i in range(3)])\n"
        "descs = ffi.new('void *[3]', [desc] * 3)  # kept: a struct does not own what it points to\n"
        "msg = ffi.new('struct fi_msg *', {'msg_iov': iov, 'desc': descs, 'iov_count': 3, "
        "'addr': me, 'context': ctx})\n"
        "poller.until_posted(lambda: fi.posted('fi_sendmsg', lib.fi_sendmsg(ep, msg, "
        "lib.FI_COMPLETION)), 10, 'the SEND')",
        "more than 2 buffers in one SEND or WRITE", ["efa-direct"]),
    "WRITE above 1 GiB": ("write(size=(1 << 30) + 4096)", "a WRITE larger than 1 GiB",
                          ["efa-direct"]),
    "WRITE with an immediate above 1 GiB": (
        "write(size=(1 << 30) + 4096, data=5)",
        "a WRITE with an immediate larger than 1 GiB (efa's segment", ["efa"]),
    "injected WRITE of 64 bytes": (
        "poller.until_posted(lambda: fi.writemsg(ep, src.ptr, 64, desc, me, base, key, ctx, "
        "flags=lib.FI_COMPLETION | lib.FI_INJECT), 10, 'the WRITE')",
        "an injected WRITE of more than 0 bytes", ["efa-direct"]),
    "target without its initiator in the AV": (
        "tdomain, tcq, _, tep = fi.open_endpoint(own, info, cq_size=8)\n"
        "tdst = memory.Buffer(1 << 16)\n"
        "tkey = fi.mr_key(memory.register(own, tdomain, tdst, lib.FI_REMOTE_WRITE, key=7))\n"
        "target, tpoller = fi.av_insert(av, fi.getname(tep)), fi.Poller(tcq)\n"
        "poller.until_posted(lambda: tpoller.poll() >= 0 and fi.writemsg(ep, src.ptr, 64, "
        "desc, target, fi.remote_base(info, tdst.ptr), tkey, ctx, data=5), 10, 'the WRITE')\n"
        "tpoller.wait_remote_data(10, 'the immediate')",
        AV.split(": ", 1)[1], ["efa-direct"]),
    "mutex wait object": (WAITING.format(wait="FI_WAIT_MUTEX_COND"), "a CQ wait object",
                          EFA),  # which of the two words: test_efa_cq_wait_objects_by_version
    # verbs: an endpoint keeps to its own NIC's entry (virtual NICs differ under the rules)
    "endpoint on another NIC's domain": (
        "nic0, nic1 = fi.rules.virtual_nics(info, 2)\n"
        "own(fi.endpoint_open(own(fi.domain_open(own(fi.fabric_open(nic0)), nic0)), nic1))",
        "an endpoint opened on a domain with the fi_info of another domain", ["verbs"]),
    # every rule set
    "batch left open": (
        "poller.until_posted(lambda: fi.writemsg(ep, src.ptr, 64, desc, me, base, key, ctx, "
        "flags=lib.FI_COMPLETION | lib.FI_MORE), 10, 'the WRITE')\npoller.poll()",
        MORE, RULES),
}
# What shm alone cannot be shown taking: a WRITE of 1 GiB and more from a 64 KiB buffer, a
# CQ that waits on a mutex (shm 1.17: -FI_ENOSYS) or an fd (1.17 and 2.6.0: -FI_ENOSYS), the
# descriptor of a closed registration (it points at memory the provider freed, which shm
# may read: SIGSEGV in CI, 2.1.0)
SHM_CANNOT = {"WRITE above 1 GiB", "WRITE with an immediate above 1 GiB", "mutex wait object",
              "fd wait object", "closed registration"}


def run_broken(broken, rules=None):
    program = rules_program(broken)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=local_env(env(rules) if rules else {}), timeout=30, cwd=ROOT)


@pytest.mark.parametrize("rule,rules", [  # the fast tier: each rule under the sets that have it
    pytest.param(rule, rules, marks=() if rules in BROKEN[rule][2] else pytest.mark.long)
    for rule in BROKEN for rules in RULES])
def test_a_broken_rule_is_one_line(rule, rules):
    broken, words, where = BROKEN[rule]
    if rules not in where and rule in SHM_CANNOT:
        pytest.skip(f"shm cannot take it, so nothing shows {rules} letting it through")
    done = run_broken(broken, rules)
    if rules not in where:
        assert done.returncode == 0, done.stderr  # not a rule of this NIC
        return
    assert_one_line_error(done, f"rules of {rules}: {words}")


@pytest.mark.long
@pytest.mark.parametrize("rule", [rule for rule in BROKEN if rule not in SHM_CANNOT])
def test_shm_alone_lets_it_through(rule):
    """What the rules catch, shm itself takes: the checks are what find it."""
    done = run_broken(BROKEN[rule][0])
    assert done.returncode == 0, done.stderr


def test_efa_takes_an_fd_wait_object_with_its_shm_path_off():
    """From 2.5, with FI_EFA_ENABLE_SHM_TRANSFER=0 efa opens no shm domain and so takes
    FI_WAIT_FD (rdm/efa_rdm_cq.c, efa_rdm_cq_configure_wait; efa_shm.c): the rule lets it
    through, to shm, which has no such CQ (-FI_ENOSYS)."""
    program = rules_program(WAITING.format(wait="FI_WAIT_FD"))
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=local_env({**env("efa"), "FI_EFA_ENABLE_SHM_TRANSFER": "0"}),
                          timeout=30, cwd=ROOT)
    if "efa" in WAITS:
        assert_one_line_error(done, f"fi_cq_open: {fi.strerror(-lib.FI_ENOSYS)}")
    else:
        assert_one_line_error(done, f"rules of efa: {WAIT}")


def version(major, minor):
    return major << 16 | minor  # FI_VERSION


@pytest.mark.parametrize("rules,since", [("efa", (2, 5)), ("efa-direct", (2, 3))])
def test_efa_cq_wait_objects_by_version(rules, since):
    """The rule on both sides of its version line, whatever libfabric is loaded here:
    before it an EFA CQ takes FI_WAIT_NONE only; from it FI_WAIT_UNSPEC and FI_WAIT_FD
    too (efa: FD only with its shm path off), never another kind."""
    mode = lib.RULES_EFA if rules == "efa" else lib.RULES_EFA_DIRECT
    before, since = version(since[0], since[1] - 1), version(*since)

    def said(at, wait, shm=1):
        rc = lib.tut_rules_wait(mode, at, wait, shm)
        return fi.ffi.string(lib.tut_rules_text(rc)).decode() if rc else None

    for at in (before, since, version(2, 6)):
        assert said(at, lib.FI_WAIT_NONE) is None
    for wait in (lib.FI_WAIT_UNSPEC, lib.FI_WAIT_FD, lib.FI_WAIT_MUTEX_COND):
        assert said(before, wait, shm=0).startswith(WAIT)
        assert said(version(1, 17), wait, shm=0).startswith(WAIT)
    for at in (since, version(2, 6)):
        assert said(at, lib.FI_WAIT_UNSPEC) is None
        assert said(at, lib.FI_WAIT_FD, shm=0) is None
        assert (said(at, lib.FI_WAIT_FD) is None) == (rules == "efa-direct")  # no shm path
        assert said(at, lib.FI_WAIT_MUTEX_COND) == OTHER_WAIT


WORKER = """\
import common._native11 as native
lane = multinet.Lane(own, info)
lane.peer, lane.iters = fi.av_insert(lane.av, fi.getname(lane.ep)), 2
desc = fi.mr_desc(memory.register(own, lane.domain, src, lib.FI_WRITE, key=4))
key = fi.mr_key(memory.register(own, lane.domain, dst, lib.FI_REMOTE_WRITE, key=5))
region = (fi.remote_base(info, dst.ptr), dst.size, {key})
lane.messages, lane.keep = write_messages(src, 4096, [0], [0], [region], {desc}, lane.peer)
errors, kept = [], []
workers.call(native, [lane], errors, kept, native.ffi.new("uint64_t *"), native.ffi.new("int *"))
if errors:
    raise errors[0]
"""


@pytest.mark.parametrize("desc,key,words", [
    ("ffi.NULL", "key", "FI_MR_LOCAL: a buffer without a descriptor"),
    ("desc", "5", "FI_MR_PROV_KEY: a WRITE with a key"),
], ids=["descriptor", "requested key"])
def test_a_c_worker_is_checked_too(desc, key, words):
    """Chapter 11's worker posts from C, with messages Python built: the same checks."""
    program = WORKER.format(desc=desc, key=key)
    assert_one_line_error(run_broken(program, "efa"), f"(worker): rules of efa: {words}")


def test_virt_addr_is_left_out_of_the_hints():
    """efa and verbs have FI_MR_VIRT_ADDR; the rules take it away, to check the offsets."""
    program = "print('VIRT_ADDR', bool(info.domain_attr.mr_mode & lib.FI_MR_VIRT_ADDR))"
    assert "VIRT_ADDR False" in run_broken(program, "verbs").stdout
    assert "VIRT_ADDR True" in run_broken(program).stdout  # shm uses addresses when let


def test_a_twin_of_another_fabric_is_refused():
    """Every entry is followed by a twin for the same domain name: opening it breaks a rule."""
    program = ("twin = info.next\n"
               "assert fi.string(twin.domain_attr.name) == fi.string(info.domain_attr.name)\n"
               "assert twin.addr_format != info.addr_format\n"
               "fi.open_endpoint(own, twin)")
    assert_one_line_error(run_broken(program, "efa"), "rules of efa: an fi_info entry of "
                          "another fabric or address format for the same domain")


@pytest.mark.parametrize("rules", RULES)
def test_a_batch_closed_without_fi_more_passes(rules):
    """The rule against an open batch lets a closed one through: FI_MORE, then a WRITE
    without it, then the CQ read."""
    program = ("poller.until_posted(lambda: fi.writemsg(ep, src.ptr, 64, desc, me, base, key, "
               "ctx, flags=lib.FI_COMPLETION | lib.FI_MORE), 10, 'the WRITE')\n"
               "poller.until_posted(lambda: fi.writemsg(ep, src.ptr, 64, desc, me, base, key, "
               "ctx + 1), 10, 'the WRITE')\n"
               "poller.wait_all([ctx, ctx + 1], 10, 'both WRITEs')")
    done = run_broken(program, rules)
    assert done.returncode == 0, done.stderr


def test_an_unknown_rule_set_is_one_line():
    done = subprocess.run([sys.executable, str(chapter_path(4))], capture_output=True, text=True,
                          env=local_env(env("ib")), timeout=30)
    assert_one_line_error(done, "FABRIC_RULES=ib: expected one of efa, efa-direct, verbs")

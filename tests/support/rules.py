"""What the tests of FABRIC_RULES (common/fabric/rules.py) share (tests/test_fabric_rules.py,
tests/test_fabric_efa_direct.py, tests/test_fabric_fi_more.py): a client's run, the words of a
rule's
error line, and a program that breaks a rule."""
import textwrap

SMALL = ["--buffer-size", "4M", "--pages", "0-63", "--iters", "3001"]
AV = "rules of efa-direct: a WRITE arrived at an endpoint whose AV has no peer in it"

PROGRAM = """\
from common import cli
from common.engine import multinet, workers
from common.fabric import memory
from common.fabric import ffi, lib
from common.fabric.connect import write_messages
import common.fabric as fi

def main():
    info, _ = fi.pick("shm", lib.FI_MSG | lib.FI_RMA)
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info, cq_size=8)
        me = fi.av_insert(av, fi.getname(ep))
        src, dst = memory.Buffer(1 << 16), memory.Buffer(1 << 16)
        src_mr = memory.register(own, domain, src, lib.FI_SEND | lib.FI_WRITE, key=1)
        dst_mr = memory.register(own, domain, dst, lib.FI_RECV | lib.FI_REMOTE_WRITE, key=2)
        desc, key, ctx = fi.mr_desc(src_mr), fi.mr_key(dst_mr), ffi.new("struct fi_context2[8]")
        base, poller = fi.remote_base(info, dst.ptr), fi.Poller(cq)
        def write(size=4096, desc=desc, key=key, data=None):
            poller.until_posted(lambda: fi.writemsg(ep, src.ptr, size, desc, me, base, key, ctx,
                                                    data=data), 10, "the WRITE")
{broken}

cli.run(main)
"""


def program(broken):
    """A program on shm that opens an endpoint, registers two buffers and then runs the
    lines `broken` (which may call write())."""
    return PROGRAM.format(broken=textwrap.indent(broken, " " * 8))

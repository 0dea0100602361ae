"""Chapter 04 - hello: one SEND, one RECV, one NIC.

What you will learn: the libfabric objects a program opens before it can move
a byte (fabric -> domain -> CQ, AV -> endpoint), how an RDM endpoint is
addressed (a raw name you pass to the peer out of band), why every buffer is
registered (FI_MR_LOCAL providers demand it), and that nothing happens until
you poll the completion queue.

New since chapter 03: we open the objects that 03 only listed.

    .venv/bin/python chapters/04_hello.py                       # server: prints its address
    .venv/bin/python chapters/04_hello.py ADDRESS "hello"       # client: sends one message
    .venv/bin/python scripts/pair.py 04                         # both, on this host

Transcript: results/04_hello/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## Motivation
# A server and a client on an RDM ("reliable datagram") endpoint: no
# connection, just an address vector (AV) that turns a peer's raw address
# into an fi_addr_t. The server prints its address; you copy it to the client.

# %%
import time

from common import bounds, cli
from common.fabric import connect, ffi, lib
import common.fabric as fi

MAX_MESSAGE = 4096  # bytes; the one registered buffer on each side


def open_endpoint(own, info):
    """fabric -> domain -> CQ + AV -> endpoint, bound and enabled."""
    fabric = own(fi.fabric_open(info))          # the provider's network
    domain = own(fi.domain_open(fabric, info))  # one NIC
    size = fi.cq_size_for(info)                 # room for all that can be in flight
    cq = own(fi.cq_open(domain, size))          # where completions arrive
    av = own(fi.av_open(domain))                # peer address -> fi_addr_t
    ep = own(fi.endpoint_open(domain, info))    # what sends and receives
    fi.ep_bind(ep, cq, lib.FI_SEND | lib.FI_RECV)
    fi.ep_bind(ep, av)
    fi.enable(ep)
    return domain, cq, av, ep


def register(own, domain, access):
    """One buffer, registered: providers with FI_MR_LOCAL want its descriptor."""
    buf = ffi.new("char[]", MAX_MESSAGE)
    mr = own(fi.mr_reg(domain, buf, MAX_MESSAGE, access, key=1))
    return buf, fi.mr_desc(mr)


# %% [markdown]
# ## Code

# %%
def server(info, args):
    with fi.Closer() as own:
        domain, cq, av, ep = open_endpoint(own, info)
        buf, desc = register(own, domain, lib.FI_RECV)
        ctx = ffi.new("struct fi_context2 *")  # must live until the completion
        # Post the receive before anyone can send: a message needs a buffer.
        if not fi.recvmsg(ep, buf, MAX_MESSAGE, desc, lib.FI_ADDR_UNSPEC, ctx):
            raise fi.FabricError("fi_recvmsg", -lib.FI_EAGAIN)  # a fresh endpoint is never full
        addr = fi.getname(ep).hex()
        print(f"server address: {addr}")
        print(cli.client_hint(args, addr, extra=["hello"]), flush=True)

        entries = fi.cq_entries(1)
        own_lock = fi.OwnLock(ep)  # shm before 1.18: a client killed mid-SEND ends this wait
        while own_lock.held() or not fi.cq_read(cq, entries):  # polling also drives progress
            pass
        message = ffi.buffer(buf, entries[0].len)[:]
        if connect.is_connect(message):  # a later chapter's client: its first SEND says so
            _, chapter, _ = connect.PREAMBLE.unpack_from(message)
            raise ValueError(f"received a CONNECT from chapter {chapter:02d}'s client, not a "
                             f"text: run chapter {chapter:02d}'s server for that client")
        print(f"received {entries[0].len} bytes: {message.decode(errors='replace')}")


def client(info, args, addr, message):
    with fi.Closer() as own:
        domain, cq, av, ep = open_endpoint(own, info)
        buf, desc = register(own, domain, lib.FI_SEND)
        server_addr = fi.av_insert(av, addr)
        buf[0:len(message)] = message
        ctx = ffi.new("struct fi_context2 *")
        entries = fi.cq_entries(1)
        # The watchdog's deadline too: a provider call that never returns still ends us
        # (common/bounds.py).
        with bounds.Deadline(args.timeout, f"no send completion within {args.timeout:g} s: "
                             "is the server running?") as deadline:
            # -FI_EAGAIN: the provider cannot take it yet (tcp connects lazily);
            # polling the CQ lets it make progress, then we try again.
            def post():
                return fi.sendmsg(ep, buf, len(message), desc, server_addr, ctx)
            while not post():
                fi.cq_read(cq, entries)
                if time.monotonic() > deadline.at:
                    # 1.x's shm: leave the server time to read our request to be mapped
                    if not fi.connreq_pending(ep, post, lambda: fi.cq_read(cq, entries)):
                        raise TimeoutError(f"server did not take the message within "
                                           f"{args.timeout:g} s: is it running?")
                    break
            while not fi.cq_read(cq, entries):
                if time.monotonic() > deadline.at:
                    raise TimeoutError(deadline.what)
        print(f"sent {len(message)} bytes: {message.decode()}")


def main():
    p = cli.parser(__doc__)
    cli.add_peer(p)
    p.add_argument("message", nargs="?", default="Hello, libfabric!",
                   help="client: what to send (default: 'Hello, libfabric!')")
    args = p.parse_args()
    message = args.message.encode()
    if len(message) > MAX_MESSAGE:
        raise cli.UsageError(f"message is {len(message)} bytes; the buffer holds {MAX_MESSAGE}")

    info, addr = cli.peer(args)
    if addr is None:
        return server(info, args)
    return client(info, args, addr, message)


if __name__ == "__main__":
    cli.run(main)

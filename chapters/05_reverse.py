"""Chapter 05 - reverse: the server answers, so it must learn the client's address.

What you will learn: on an RDM endpoint nothing tells the server who sent a
message, so the client's first SEND is a CONNECT carrying its own address;
the server inserts it into its address vector and can then SEND back. Each
side keeps a receive posted before the peer can send to it.

New since chapter 04: messages in both directions, a CONNECT message, the
server serving one client after another (fi_av_remove when done). What 04
taught now comes from common.fabric: open_endpoint (the same fi_* calls) and
Poller, which keeps completions by context since two operations can now be in
flight at once.

    python chapters/05_reverse.py                     # server: prints its address
    python chapters/05_reverse.py ADDRESS "hello"     # client: prints "olleh"
    python scripts/pair.py 05                         # both, on this host

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, tcp on loopback):

    $ FI_TCP_IFACE=lo python chapters/05_reverse.py -p tcp --clients 2
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    server address: 020090b97f0000010000000000000000
    run the client: python chapters/05_reverse.py -p tcp 020090b97f0000010000000000000000 'hello'
    client 1: 'hello' -> 'olleh'
    client 2: 'libfabric' -> 'cirbafbil'

    $ FI_TCP_IFACE=lo python chapters/05_reverse.py -p tcp 020090b97f0000010000000000000000 hello      # another terminal
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    sent 'hello', got back 'olleh'
    $ FI_TCP_IFACE=lo python chapters/05_reverse.py -p tcp 020090b97f0000010000000000000000 libfabric
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    sent 'libfabric', got back 'cirbafbil'
"""
# %% [markdown]
# ## Motivation
# Chapter 04 could only talk one way. Here the client introduces itself:
#
#     client                              server
#     CONNECT(client address)  ------->   fi_av_insert -> fi_addr
#     TEXT("hello")            ------->   reverse
#                              <-------   TEXT("olleh")

# %%
import sys

from common import cli
from common.fabric import ffi, lib
import common.fabric as fi

MAX_MESSAGE = 4096  # bytes per buffer
CONNECT, TEXT = b"C", b"T"  # first byte of every message says what it carries


class Buffer:
    """One registered message buffer and the context of the operation using it."""

    def __init__(self, own, domain, key):
        self.mem = ffi.new("char[]", MAX_MESSAGE)
        mr = own(fi.mr_reg(domain, self.mem, MAX_MESSAGE, lib.FI_SEND | lib.FI_RECV, key=key))
        self.desc = fi.mr_desc(mr)
        self.ctx = ffi.new("struct fi_context2 *")  # must live until the completion

    def recv(self, ep):
        if not fi.recvmsg(ep, self.mem, MAX_MESSAGE, self.desc, lib.FI_ADDR_UNSPEC, self.ctx):
            raise fi.FabricError("fi_recvmsg", -lib.FI_EAGAIN)  # never full: 2 recvs at most

    def send(self, ep, poller, dest, kind, payload, timeout):
        """SEND kind+payload to dest and wait for its completion."""
        message = kind + payload
        self.mem[0:len(message)] = message
        poller.until_posted(lambda: fi.sendmsg(ep, self.mem, len(message), self.desc, dest,
                                               self.ctx), timeout, "message accepted")
        poller.wait([self.ctx], timeout, "send completion: is the peer still there?")

    def received(self, length):
        """(kind, payload) of the message that landed in this buffer."""
        data = ffi.buffer(self.mem, length)[:]
        return data[:1], data[1:]


# %% [markdown]
# ## Code

# %%
def server(info, args):
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        poller = fi.Poller(cq)
        inbox = [Buffer(own, domain, key=1), Buffer(own, domain, key=2)]
        outbox = Buffer(own, domain, key=3)
        for b in inbox:  # two receives posted: a client sends CONNECT and TEXT back to back
            b.recv(ep)
        addr = fi.getname(ep).hex()
        print(f"server address: {addr}")
        print(f"run the client: python {sys.argv[0]} -p {args.provider_used} {addr} 'hello'",
              flush=True)

        client, served = None, 0
        while not args.clients or served < args.clients:
            ctx, length = poller.wait([b.ctx for b in inbox], None, "message")
            buf = next(b for b in inbox if b.ctx == ctx)
            kind, payload = buf.received(length)
            buf.recv(ep)  # repost at once: the next message may be on its way
            if kind == CONNECT:
                if client is not None:
                    fi.av_remove(av, client)  # the previous client never sent its text
                client = fi.av_insert(av, payload)
                continue
            if kind != TEXT or client is None:
                print(f"ignored a {len(payload)}-byte message of kind {kind!r}", file=sys.stderr)
                continue
            served += 1
            text = payload.decode(errors="replace")
            try:
                outbox.send(ep, poller, client, TEXT, text[::-1].encode(), args.timeout)
                print(f"client {served}: {text!r} -> {text[::-1]!r}", flush=True)
            except (fi.FabricError, TimeoutError) as e:  # that client is gone; serve the next
                print(f"client {served}: reply failed: {e}", file=sys.stderr, flush=True)
            fi.av_remove(av, client)
            client = None


def client(info, args, addr, message):
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        poller = fi.Poller(cq)
        inbox, outbox = Buffer(own, domain, key=1), Buffer(own, domain, key=2)
        server_addr = fi.av_insert(av, addr)
        inbox.recv(ep)  # before we speak: the reply needs somewhere to land
        outbox.send(ep, poller, server_addr, CONNECT, fi.getname(ep), args.timeout)
        outbox.send(ep, poller, server_addr, TEXT, message, args.timeout)
        _, length = poller.wait([inbox.ctx], args.timeout, "reply from the server")
        kind, reply = inbox.received(length)
        reply = reply.decode(errors="replace")
        print(f"sent {message.decode()!r}, got back {reply!r}")
        if kind != TEXT or reply != message.decode()[::-1]:
            raise ValueError("the reply is not the reversed message")


def main():
    p = cli.parser(__doc__)
    cli.add_peer(p)
    p.add_argument("message", nargs="?", default="Hello, libfabric!")
    p.add_argument("--clients", type=int, default=0,
                   help="server: exit after this many clients (default: serve until Ctrl-C)")
    args = p.parse_args()
    message = args.message.encode()
    if len(message) + 1 > MAX_MESSAGE:
        raise cli.UsageError(f"message is {len(message)} bytes; the buffer holds "
                             f"{MAX_MESSAGE - 1} after the 1-byte kind")
    if args.clients < 0:
        raise cli.UsageError("--clients must be 0 (no limit) or more")

    info, addr = cli.peer(args)
    if addr is None:
        return server(info, args)
    return client(info, args, addr, message)


if __name__ == "__main__":
    cli.run(main)

"""Chapter 05 - reverse: the server answers, so it must learn the client's address.

What you will learn: on an RDM endpoint nothing tells the server who sent a
message, so the client's first SEND is a CONNECT carrying its own address;
the server inserts it into its address vector and can then SEND back. Each
side keeps a receive posted before the peer can send to it. CONNECT opens
with a magic and the client's chapter (common/fabric/connect.py, the same in every
later chapter), so a server refuses another chapter's client by name; and no
message is larger than one SEND the NIC carries whole (fabric.max_send).

New since chapter 04: messages in both directions, a CONNECT message, the
server serving one client after another (fi_av_remove when done). What 04
taught now comes from common.fabric: open_endpoint (the same fi_* calls) and
Poller, which keeps completions by context since two operations can now be in
flight at once.

    .venv/bin/python chapters/05_reverse.py                     # server: prints its address
    .venv/bin/python chapters/05_reverse.py ADDRESS "hello"     # client: prints "olleh"
    .venv/bin/python scripts/pair.py 05                         # both, on this host

Transcript: results/05_reverse/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## Motivation
# Chapter 04 could only talk one way. Here the client introduces itself:
#
#     client                              server
#     CONNECT(magic, chapter 05,
#             client address)  ------->   fi_av_insert -> fi_addr
#     TEXT("hello")            ------->   reverse
#                              <-------   TEXT("olleh")

# %%
import sys

from common import cli
from common.fabric import connect
from common.fabric import ffi, lib
import common.fabric as fi

CHAPTER = 5
TEXT = b"T"  # the first byte of a text; a CONNECT starts with common.fabric.connect.MAGIC


class Buffer:
    """One registered message buffer, as large as one SEND the NIC carries whole
    (fi.max_send), and the context of the operation using it."""

    def __init__(self, own, info, domain, key):
        self.size = fi.max_send(info)
        self.mem = ffi.new("char[]", self.size)
        mr = own(fi.mr_reg(domain, self.mem, self.size, lib.FI_SEND | lib.FI_RECV, key=key))
        self.desc = fi.mr_desc(mr)
        self.ctx = ffi.new("struct fi_context2 *")  # must live until the completion

    def recv(self, ep):
        if not fi.recvmsg(ep, self.mem, self.size, self.desc, lib.FI_ADDR_UNSPEC, self.ctx):
            raise fi.FabricError("fi_recvmsg", -lib.FI_EAGAIN)  # never full: 2 recvs at most

    def send(self, ep, poller, dest, message, timeout):
        """SEND `message` to dest and wait for its completion."""
        self.mem[0:len(message)] = message
        poller.until_posted(lambda: fi.sendmsg(ep, self.mem, len(message), self.desc, dest,
                                               self.ctx), timeout, "message accepted", ep)
        poller.wait([self.ctx], timeout, "send completion: is the peer still there?")

    def received(self, length):
        """The message that landed in this buffer."""
        return ffi.buffer(self.mem, length)[:]


# %% [markdown]
# ## Code

# %%
def server(info, args):
    served, name = 0, None
    while not args.clients or served < args.clients:
        with fi.Closer() as own:  # the endpoint: opened again, at its address, when renewed
            domain, cq, av, ep = fi.open_endpoint(own, fi.at_address(info, name))
            if name is None:
                name = fi.getname(ep)
                print(f"server address: {name.hex()}")
                print(cli.client_hint(args, name.hex(), extra=["hello"]), flush=True)
            served = serve(own, info, domain, cq, av, ep, args, served)

def serve(own, info, domain, cq, av, ep, args, served):
    """Serve clients on `ep` until --clients have been (`served` so far), or until a dead
    client leaves the endpoint deaf (fabric.EndpointDeaf); returns how many."""
    poller = fi.Poller(cq, ep=ep)
    inbox = [Buffer(own, info, domain, key=1), Buffer(own, info, domain, key=2)]
    outbox = Buffer(own, info, domain, key=3)
    for b in inbox:  # two receives posted: a client sends CONNECT and TEXT back to back
        b.recv(ep)
    client = None
    while not args.clients or served < args.clients:
        try:  # a client that CONNECTed owes its text within --timeout
            ctx, length = poller.wait([b.ctx for b in inbox],
                                      None if client is None else args.timeout,
                                      "text after the CONNECT", idle=client is None)
        except fi.EndpointDeaf as e:  # (a TimeoutError too) a dead client: a new endpoint
            connect.renewing(e)
            return served
        except TimeoutError as e:
            client = let_go(av, client, served, e)
            served += 1
            continue
        except fi.CompletionError as e:  # a message longer than our buffer: one line (on
            # tcp; on shm it never completes, connect.next_request says why)
            buf = next((b for b in inbox if fi.key(b.ctx) == fi.key(e.context)), None)
            if buf is None or not connect.too_long(e, buf.size):
                raise
            buf.recv(ep)
            continue
        buf = next(b for b in inbox if b.ctx == ctx)
        message = buf.received(length)
        buf.recv(ep)  # repost at once: the next message may be on its way
        if connect.is_connect(message):
            if client is not None:  # the previous client never sent its text
                client = let_go(av, client, served, "a CONNECT came before its text")
                served += 1
            try:  # a client's bytes are never trusted: one line, and the next client
                address, _, why = connect.unpack(message, CHAPTER)
                client = fi.av_insert(av, address, info)
            except (ValueError, fi.FabricError) as e:
                connect.report(served + 1, e)
                served += 1
                continue
            if not why:
                continue
            reply = connect.refusal(why)  # a client of another chapter: told why
        elif message[:1] == TEXT and client is not None:
            text, why = message[1:].decode(errors="replace"), None
            reply = TEXT + text[::-1].encode()
        else:
            print(f"ignored a {len(message)}-byte message: neither a CONNECT nor a text "
                  "after one", file=sys.stderr)
            continue
        try:
            outbox.send(ep, poller, client, reply, args.timeout)
            if why:
                connect.report(served + 1, connect.Refused(why))
            else:
                print(f"client {served + 1}: {text!r} -> {text[::-1]!r}", flush=True)
        except (fi.FabricError, TimeoutError) as e:  # that client is gone; serve the next
            connect.report(served + 1, e)
        served += not why  # another chapter's client, told so: not one of --clients
        fi.av_remove(av, client)
        client = None
    return served


def let_go(av, client, served, why):
    """A client that CONNECTed and sent no text: said in one line, out of the AV."""
    connect.report(served + 1, why if isinstance(why, Exception) else ValueError(why))
    fi.av_remove(av, client)
    return None


def client(info, args, addr, message):
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        poller = fi.Poller(cq)
        inbox, outbox = Buffer(own, info, domain, key=1), Buffer(own, info, domain, key=2)
        server_addr = fi.av_insert(av, addr)
        inbox.recv(ep)  # before we speak: the reply needs somewhere to land
        outbox.send(ep, poller, server_addr, connect.pack(CHAPTER, fi.getname(ep), b""),
                    args.timeout)
        outbox.send(ep, poller, server_addr, TEXT + message, args.timeout)
        _, length = poller.wait([inbox.ctx], args.timeout, "reply from the server")
        reply = connect.heard(inbox.received(length))
        text = reply[1:].decode(errors="replace")
        print(f"sent {message.decode()!r}, got back {text!r}")
        if reply[:1] != TEXT or text != message.decode()[::-1]:
            raise ValueError("the reply is not the reversed message")


def main():
    p = cli.parser(__doc__)
    cli.add_peer(p)
    p.add_argument("message", nargs="?", default="Hello, libfabric!",
                   help="client: what to send (default: 'Hello, libfabric!')")
    cli.add_clients(p)
    args = p.parse_args()
    message = args.message.encode()

    info, addr = cli.peer(args)
    if len(message) + 1 > fi.max_send(info):
        raise cli.UsageError(f"message is {len(message)} bytes; the buffer holds "
                             f"{fi.max_send(info) - 1} after the 1-byte kind (one SEND "
                             "that the NIC carries whole)")
    if addr is None:
        return server(info, args)
    return client(info, args, addr, message)


if __name__ == "__main__":
    cli.run(main)

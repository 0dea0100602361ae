"""Chapter 06 - write: one-sided RDMA WRITE into the client's (GPU) memory, with immediate data.

What you will learn: with RMA the server writes straight into the client's
registered memory; the client's CPU takes no part until it is told the data
is there. To allow that, the client registers its buffers for remote writes
(FI_REMOTE_WRITE) and sends, per buffer, the remote address and the key of
its registration. The last WRITE carries immediate data (FI_REMOTE_CQ_DATA),
which is the one thing the client's CQ sees. With `--gpu N` the client's
buffers are GPU memory, registered with iface FI_HMEM_CUDA (GPUDirect RDMA
on EFA; CUDA IPC on shm) - a libfabric built with CUDA is needed for that.
--bad-key shows who notices a wrong key (the cell "Who notices a wrong key").

New since chapter 05: FI_RMA, buffers registered for remote access, the
CONNECT message grows a list of (address, size, key) and a request ("fill
these pages from this seed", the pages as runs of consecutive ones),
fi_writemsg, immediate data, a check of every byte that arrived.

    .venv/bin/python chapters/06_write.py                                   # server
    .venv/bin/python chapters/06_write.py ADDRESS --pages 0,3,5-9           # client
    .venv/bin/python chapters/06_write.py --gpu 0                           # server, pages on GPU 0
    .venv/bin/python chapters/06_write.py ADDRESS --gpu 1 --page-size 1M --buffer-size 16M   # into GPU 1

Transcripts (host memory; GPU memory on one H200): results/06_write/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "wrong bytes", "visible": {"at_most": 0}}

# %% [markdown]
# ## Who notices a wrong key (--bad-key)
# --bad-key (client) sends a key that no registration has; who notices is the
# provider's choice, and the client, which checks the immediate data and every
# byte, is the one side that always does. shm copies a WRITE without immediate
# data itself, by CMA into the target's memory, checking no key, wrong or right
# (smr_rma_fast, prov/shm/src/smr_rma.c, in 1.17, 2.1 and 2.6 alike); only a WRITE
# through the target's command queue (with immediate data, like our last, or
# without CMA) has its key checked there (ofi_mr_map_verify in smr_progress.c).
# Before 2.5 the target then drops it unanswered: the server gives up with "no
# last WRITE completion within 3 s" (--timeout 3). From 2.5's new shm the target
# hands the command back without an error, so the writer's WRITEs all complete:
# the server says "wrote 16 pages", and only the client, which gets no immediate
# data, fails. tcp checks every WRITE on arrival (xnet_handle_write,
# prov/tcp/src/xnet_progress.c) and closes the connection: the server says
# "client 1: failed: fi_cq_read: ..." where a WRITE had not yet completed, and
# on a busy machine all 16 may have. EFA's device fails the WRITE on the writer's
# CQ: "Remote key (RKEY) not registered or does not match remote IOVA"
# (prov/efa/src/efa_errno.h). In every case the client ends with "no WRITE with
# immediate data from the server within 5 s" (--timeout 5): a silent target is
# why it checks instead of trusting the absence of an error.

# %% [markdown]
# ## Motivation
#     client                                         server
#     register B buffers (FI_REMOTE_WRITE)
#     CONNECT(magic, 06, address,
#             [(addr, size, key)] x B,
#             page size, seed, page runs) ------->   fi_av_insert
#                                                    fill pages from the seed
#                                      <----------   WRITE page, WRITE page, ...
#                                      <----------   WRITE last page + immediate data
#     CQ: FI_REMOTE_CQ_DATA -> check every byte

# %%
import struct

from common import cli
from common.fabric import connect, memory
from common.fabric import ffi, lib
import common.fabric as fi

CHAPTER = 6
CAPS = lib.FI_MSG | lib.FI_RMA
HEADER = struct.Struct("<QQIH")  # seed, page size, number of page runs, of buffers
REGION = struct.Struct("<QQQ")   # remote address, size, key: what a WRITE needs per buffer
BAD_KEY = 0xBAD0_0000  # --bad-key: a key no registration of ours has


# %% [markdown]
# ## Code

# %%
def server(info, args):
    served, backlog, name = 0, [], None  # backlog: a CONNECT kept across a renewal
    while not args.clients or served < args.clients:
        held = []  # a failed client's data and contexts, which WRITEs still out may use
        with fi.Closer() as own:  # the endpoint: opened again, at its address, when renewed
            domain, cq, av, ep = fi.open_endpoint(own, fi.at_address(info, name))
            poller = fi.Poller(cq, ep=ep)
            inbox = fi.Inbox(own, domain, ep, fi.max_send(info))
            if name is None:
                name = fi.getname(ep)
                print(f"server address: {name.hex()}")
                print(cli.client_hint(args, name.hex()), flush=True)
            while not args.clients or served < args.clients:
                request = connect.next_client(poller, inbox, backlog)
                if request is None:  # a dead client's lock: a new endpoint
                    break
                try:
                    with fi.Closer() as client_own:  # what one client needs, released after it
                        serve(client_own, info, domain, ep, av, poller, request, args, held)
                except (fi.FabricError, TimeoutError, ValueError) as e:  # serve the next one
                    connect.report(served + 1, e)
                    if isinstance(e, connect.Refused):
                        continue  # another chapter's client, told so: not one of --clients
                served += 1
                if held and (len(held) >= connect.HELD_MAX or ordered_answers(info)):
                    connect.keep_arrived(poller, inbox, backlog)  # a new endpoint, same address
                    break


def ordered_answers(info):
    """Does a stopped client's WRITE hold up the completions of every later one? 1.x's shm
    takes the answers to our commands in the order it sent them, and stops at the first
    not given yet (smr_progress_resp, prov/shm/src/smr_progress.c): only a new endpoint
    serves the next client. 2.x's shm answers each command on its own."""
    return fi.provider_of(info) == "shm" and fi.version() < (2, 0)


def serve(own, info, domain, ep, av, poller, request, args, held):
    out = []  # WRITEs to this client that the settle gave up on (a client stopped)
    # While any is out, the client stays in our AV (connect.let_go): on shm a continued
    # client's answers to them reach our progress through it (1.17 read the unmapped
    # region of a peer taken out: SIGSEGV). A new endpoint, where it is not needed
    # (ordered_answers), would lose a client that came meanwhile: it keeps our old region
    # mapped, as shm maps a peer's name again only for another pid (smr_progress_connreq).
    client, request = connect.accept(own, info, av, domain, ep, poller, request, CHAPTER,
                                     args.timeout, busy=lambda: len(out))
    seed, page_size, runs, nbufs = connect.unpack_from(HEADER, request)
    at = HEADER.size
    regions = [connect.unpack_from(REGION, request, at + i * REGION.size) for i in range(nbufs)]
    pages = connect.unpack_pages(request, at + nbufs * REGION.size, runs, page_size)
    npages = len(pages)
    per_buffer = connect.check_targets(regions, page_size, pages)

    # The data, generated before anything is timed: page j of the request in slot j.
    source = memory.seeded_source(pages, page_size, seed, args.gpu)
    desc = fi.mr_desc(memory.register(own, domain, source, lib.FI_WRITE, key=2000))

    storage = ffi.new("struct fi_context2[]", npages)  # one context per WRITE in flight
    contexts = [storage + j for j in range(npages)]
    posted = 0
    try:
        for j, page in enumerate(pages):
            base, _, key = regions[page // per_buffer]
            last = j == npages - 1
            if last:  # all other pages completed first: the immediate means "all is there"
                poller.wait_all(contexts[0:j], args.timeout, "WRITE completions")
            poller.until_posted(lambda: fi.writemsg(
                ep, source.ptr + j * page_size, page_size, desc, client,
                base + (page % per_buffer) * page_size, key, contexts[j],
                data=npages if last else None), args.timeout, "WRITE accepted")
            posted += 1
        poller.wait_all(contexts[npages - 1:npages], args.timeout, "last WRITE completion")
    except (fi.FabricError, TimeoutError):  # the client failed: the rest of its WRITEs
        if not poller.settle(contexts[:posted], args.timeout):  # end here, not on the next
            out.append(posted)  # one's CQ; those still out (a client stopped) read `source`
            held.append((source, storage))  # until they end (tcp sends from it as its
        raise  # socket drains)
    print(f"wrote {npages} pages of {page_size} bytes from {source.kind}, "
          f"the last with immediate data {npages}", flush=True)


def client(info, args, addr):
    pages = args.pages
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        poller = fi.Poller(cq)
        inbox = fi.Inbox(own, domain, ep, len(connect.REFUSED) + connect.WHY)  # a refusal lands here
        buffers = [memory.Buffer(args.buffer_size, args.gpu) for _ in range(args.buffers)]
        mrs = [memory.register(own, domain, b, memory.WRITE_TARGET, key=i + 1)
               for i, b in enumerate(buffers)]
        print(f"memory: {args.buffers} x {args.buffer_size} bytes of {buffers[0].kind}")
        server_addr = fi.av_insert(av, addr)

        regions = [(fi.remote_base(info, b.ptr), b.size,
                    BAD_KEY if args.bad_key else fi.mr_key(mr)) for b, mr in zip(buffers, mrs)]
        poller.send(own, domain, ep, request(args, fi.getname(ep), regions), server_addr, 1001,
                    args.timeout, "CONNECT", ": is the server running?")

        _, length = poller.wait([inbox.ctx], args.timeout,
                                "WRITE with immediate data from the server", or_remote_data=True)
        if not poller.remote_data:  # a message instead: the server refused us
            connect.heard(inbox.take(length))
            raise ValueError("the server sent a message, not the immediate data")
        data = poller.remote_data.pop(0)
        print(f"remote write completion: FI_REMOTE_CQ_DATA, immediate data {data}")
        wrong = memory.count_wrong(buffers, args.page_size, args.seed, pages)
        print(f"verified {len(pages)} pages ({len(pages) * args.page_size} bytes): "
              f"{wrong} wrong bytes")
        if data != len(pages) or wrong:
            raise ValueError(f"{wrong} wrong bytes, immediate data {data} (expected {len(pages)})")


def request(args, me, regions):
    """CONNECT: who we are (`me`, our address), where to write (`regions`: per buffer, its
    remote address, size and key) and what (the pages, from the seed)."""
    runs, pages = connect.pack_pages(args.pages)
    return connect.pack(CHAPTER, me, HEADER.pack(args.seed, args.page_size, runs, len(regions))
                        + b"".join(REGION.pack(*r) for r in regions) + pages)


def main():
    p = cli.parser(__doc__)
    cli.add_peer(p)
    cli.add_pages(p, pages="0-15", buffer_size=1 << 20)
    cli.side("client", p.add_argument("--bad-key", action="store_true", help="send a wrong "
                                      "key, to see how a failed WRITE is reported"))
    args = p.parse_args()
    cli.check_pages(args, lambda per_buffer: list(range(16)))
    memory.use_gpu(args.gpu)

    # GPU memory needs FI_HMEM (shm then moves it with CUDA IPC); give --gpu to
    # both sides, since the server's endpoint is the one that writes into it.
    info, addr = cli.peer(args, CAPS, hmem=args.gpu is not None)
    mr_mode = fi.tostr(info.domain_attr.mr_mode, lib.FI_TYPE_MR_MODE) or "no mode bits"
    print(f"memory registration: {mr_mode}")
    if addr is None:
        return server(info, args)
    fake = request(args, bytes(connect.ADDRESS_BOUND), [(0, 0, 0)] * args.buffers)
    connect.fits(info, len(fake), "pages or buffers")
    return client(info, args, addr)


if __name__ == "__main__":
    cli.run(main)

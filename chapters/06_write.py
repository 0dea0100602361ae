"""Chapter 06 - write: one-sided RDMA WRITE into the client's (GPU) memory, with immediate data.

What you will learn: with RMA the server writes straight into the client's
registered memory; the client's CPU takes no part until it is told the data
is there. To allow that, the client registers its buffers for remote writes
(FI_REMOTE_WRITE) and sends, per buffer, the remote address and the key of
its registration. The last WRITE carries immediate data (FI_REMOTE_CQ_DATA),
which is the one thing the client's CQ sees. With `--gpu N` the client's
buffers are GPU memory, registered with iface FI_HMEM_CUDA (GPUDirect RDMA
on EFA; CUDA IPC on shm) - a libfabric built with CUDA is needed for that.

New since chapter 05: FI_RMA, buffers registered for remote access, the
CONNECT message grows a list of (address, size, key) and a request ("fill
these pages from this seed"), fi_writemsg, immediate data, a check of every
byte that arrived.

    python chapters/06_write.py                                   # server
    python chapters/06_write.py ADDRESS --pages 0,3,5-9           # client
    python chapters/06_write.py --gpu 0                           # server, pages on GPU 0
    python chapters/06_write.py ADDRESS --gpu 1 --page-size 1M    # into GPU 1

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory):

    $ python chapters/06_write.py -p shm
    provider: shm (asked for), fabric shm, domain shm
    memory registration: FI_MR_VIRT_ADDR
    server address: 66695f73686d3a2f2f373935323a303a3000
    run the client: python chapters/06_write.py -p shm 66695f73686d3a2f2f373935323a303a3000
    wrote 8 pages of 65536 bytes from host memory, the last with immediate data 8

    $ python chapters/06_write.py -p shm 66695f73686d3a2f2f373935323a303a3000 --pages 0,3,5-9,31
    provider: shm (asked for), fabric shm, domain shm
    memory registration: FI_MR_VIRT_ADDR
    memory: 2 x 1048576 bytes of host memory
    remote write completion: FI_REMOTE_CQ_DATA, immediate data 8
    verified 8 pages (524288 bytes): 0 wrong bytes

On one NVIDIA H200 (libfabric 2.1.0 built by scripts/build_libfabric.sh, shm, pages
and client buffers in GPU 0 memory; lines as printed by scripts/pair.py):

    $ python chapters/06_write.py -p shm --clients 1 --gpu 0
    provider: shm (asked for), fabric shm, domain shm
    memory registration: FI_MR_VIRT_ADDR, FI_MR_HMEM
    server address: 66695f73686d3a2f2f3433353a303a3000
    run the client: python chapters/06_write.py -p shm 66695f73686d3a2f2f3433353a303a3000
    wrote 16 pages of 1048576 bytes from GPU 0 memory (cuda), the last with immediate data 16

    $ python chapters/06_write.py -p shm 66695f73686d3a2f2f3433353a303a3000 --gpu 0 --page-size 1M --buffer-size 16M --pages 0-15
    provider: shm (asked for), fabric shm, domain shm
    memory registration: FI_MR_VIRT_ADDR, FI_MR_HMEM
    memory: 2 x 16777216 bytes of GPU 0 memory (cuda)
    remote write completion: FI_REMOTE_CQ_DATA, immediate data 16
    verified 16 pages (16777216 bytes): 0 wrong bytes
"""
# %% [markdown]
# ## Motivation
#     client                                         server
#     register B buffers (FI_REMOTE_WRITE)
#     CONNECT(address, [(addr, size, key)] x B,
#             page size, seed, pages)  ---------->   fi_av_insert
#                                                    fill pages from the seed
#                                      <----------   WRITE page, WRITE page, ...
#                                      <----------   WRITE last page + immediate data
#     CQ: FI_REMOTE_CQ_DATA -> check every byte

# %%
import struct
import sys

from common import cli, memory
from common.fabric import ffi, lib
import common.fabric as fi

CAPS = lib.FI_MSG | lib.FI_RMA
MAX_MESSAGE = 64 * 1024  # bytes: room for the page list
HEADER = struct.Struct("<QQIHH")  # seed, page size, number of pages, of buffers, address length
REGION = struct.Struct("<QQQ")    # remote address, size, key: what a WRITE needs per buffer
PAGE = struct.Struct("<I")
BAD_KEY = 0xBAD0_0000  # --bad-key: a key no registration of ours has


# %% [markdown]
# ## Code

# %%
def server(info, args):
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        poller = fi.Poller(cq)
        inbox = fi.Inbox(own, domain, ep, MAX_MESSAGE)
        addr = fi.getname(ep).hex()
        print(f"server address: {addr}")
        print(f"run the client: python {sys.argv[0]} -p {args.provider_used} {addr}", flush=True)
        served = 0
        while not args.clients or served < args.clients:
            _, length = poller.wait([inbox.ctx], None, "CONNECT")
            request = inbox.take(length)
            served += 1
            try:
                with fi.Closer() as client_own:  # what one client needs, released after it
                    serve(client_own, domain, ep, av, poller, request, args)
            except (fi.FabricError, TimeoutError, ValueError) as e:  # that client is gone
                print(f"client {served}: failed: {e}", file=sys.stderr, flush=True)


def serve(own, domain, ep, av, poller, request, args):
    seed, page_size, npages, nbufs, addrlen = HEADER.unpack_from(request)
    at = HEADER.size
    client = fi.av_insert(av, request[at:at + addrlen])
    own.callback(fi.av_remove, av, client)
    at += addrlen
    regions = [REGION.unpack_from(request, at + i * REGION.size) for i in range(nbufs)]
    at += nbufs * REGION.size
    pages = [PAGE.unpack_from(request, at + i * PAGE.size)[0] for i in range(npages)]
    per_buffer = regions[0][1] // page_size

    # The data, generated before anything is timed: page j of the request in slot j.
    source = memory.seeded_source(pages, page_size, seed, args.gpu)
    desc = fi.mr_desc(memory.register(own, domain, source, lib.FI_WRITE, key=2000))

    storage = ffi.new("struct fi_context2[]", npages)  # one context per WRITE in flight
    contexts = [storage + j for j in range(npages)]
    for j, page in enumerate(pages):
        base, _, key = regions[page // per_buffer]
        last = j == npages - 1
        if last:  # all other pages completed first: the immediate means "everything is there"
            poller.wait_all(contexts[0:j], args.timeout, "WRITE completions")
        poller.until_posted(lambda: fi.writemsg(
            ep, source.ptr + j * page_size, page_size, desc, client,
            base + (page % per_buffer) * page_size, key, contexts[j],
            data=npages if last else None), args.timeout, "WRITE accepted")
    poller.wait_all(contexts[npages - 1:npages], args.timeout, "last WRITE completion")
    print(f"wrote {npages} pages of {page_size} bytes from {source.kind}, "
          f"the last with immediate data {npages}", flush=True)


def client(info, args, addr):
    pages = args.pages
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info)
        poller = fi.Poller(cq)
        buffers = [memory.Buffer(args.buffer_size, args.gpu) for _ in range(args.buffers)]
        mrs = [memory.register(own, domain, b, memory.WRITE_TARGET, key=i + 1)
               for i, b in enumerate(buffers)]
        print(f"memory: {args.buffers} x {args.buffer_size} bytes of {buffers[0].kind}")
        server_addr = fi.av_insert(av, addr)

        me = fi.getname(ep)
        request = (HEADER.pack(args.seed, args.page_size, len(pages), len(buffers), len(me)) + me
                   + b"".join(REGION.pack(fi.remote_base(info, b.ptr), b.size,
                                          BAD_KEY if args.bad_key else fi.mr_key(mr))
                              for b, mr in zip(buffers, mrs))
                   + b"".join(PAGE.pack(p) for p in pages))
        poller.send(own, domain, ep, request, server_addr, 1001, args.timeout, "CONNECT",
                    ": is the server running?")

        data = poller.wait_remote_data(args.timeout, "WRITE with immediate data from the server")
        print(f"remote write completion: FI_REMOTE_CQ_DATA, immediate data {data}")
        wrong = memory.count_wrong(buffers, args.page_size, args.seed, pages)
        print(f"verified {len(pages)} pages ({len(pages) * args.page_size} bytes): "
              f"{wrong} wrong bytes")
        if data != len(pages) or wrong:
            raise ValueError(f"{wrong} wrong bytes, immediate data {data} (expected {len(pages)})")


def main():
    p = cli.parser(__doc__)
    cli.add_peer(p)
    cli.add_pages(p, pages="0-15", buffer_size=1 << 20)
    p.add_argument("--bad-key", action="store_true",
                   help="client: send a wrong key, to see how a failed WRITE is reported")
    args = p.parse_args()
    cli.check_pages(args, lambda per_buffer: list(range(16)))
    if HEADER.size + 64 + args.buffers * REGION.size + len(args.pages) * PAGE.size > MAX_MESSAGE:
        raise cli.UsageError(f"too many pages or buffers for one {MAX_MESSAGE}-byte CONNECT")
    memory.use_gpu(args.gpu)

    # GPU memory needs FI_HMEM (shm then moves it with CUDA IPC); give --gpu to
    # both sides, since the server's endpoint is the one that writes into it.
    info, addr = cli.peer(args, CAPS, hmem=args.gpu is not None)
    mr_mode = fi.tostr(info.domain_attr.mr_mode, lib.FI_TYPE_MR_MODE) or "no mode bits"
    print(f"memory registration: {mr_mode}")
    if addr is None:
        return server(info, args)
    return client(info, args, addr)


if __name__ == "__main__":
    cli.run(main)

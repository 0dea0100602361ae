"""Chapter 07 - queue: a queue for -FI_EAGAIN, 1 GiB buffers, the first throughput figure.

What you will learn: a provider takes only so many operations at once; when its queue is
full, fi_writemsg returns -FI_EAGAIN. Calling it again at once is a spin that may never
end (most providers move data only while you read their CQ), and dropping the operation
loses a page. So the writer keeps such operations in a queue of its own, reads the CQ,
and posts from the queue, oldest first, as room comes back. With that, the server can
post a million WRITEs as fast as the provider takes them, and we get the series' first
number: Gbps = 8 x page size x WRITEs / elapsed, from the first post until the client
says all the data is in its memory (LANDED), against the NIC's link speed or fi_rma_bw
on this machine (results/baselines/). Which queue is full on shm and tcp, and why the
printed client asks for --delivery-complete: the cell "Whose queue is full" below.

New since chapter 06: the pending queue (OpQueue); one context per WRITE in flight, from
a free list, so every completion is matched to exactly one WRITE; WRITE messages built
once per page; 1 GiB buffers; --iters WRITEs that cycle over the pages; a heartbeat SEND,
queued like the WRITEs, telling the client how far the server is; a Connection
(common/engine/opqueue.py) holding what serving one client takes: its address, the
queue, the heartbeat, the inbox, the CONNECTs of others waiting meanwhile; a live
progress line (on a terminal); Gbps, Mpps and % of a limit; --json. And a new endpoint,
at the address the clients were given, after a client that failed while the provider
still held WRITEs to it: only fi_close gives those back (the cell "A new endpoint after
a failed client").

    .venv/bin/python chapters/07_queue.py                                  # server (the writer)
    .venv/bin/python chapters/07_queue.py ADDRESS                          # client: 1,000,000 x 64 KiB
    .venv/bin/python chapters/07_queue.py ADDRESS --iters 20000 --page-size 1M
    .venv/bin/python chapters/07_queue.py --gpu 0 --json                   # server, pages on GPU 0

Transcripts and figures: results/07_queue/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "refused", "visible": {"at_least": 1}, "field": "refused",
          "client": "--delivery-complete --page-size 64K --buffer-size 4M --pages 0-63 "
                    "--iters 20000",
          "why_not": {"tcp": "A repeat with none refused: the provider took every WRITE, as "
                             "2.x's own tcp does (no bound on its transfers, xnet_alloc_tx); "
                             "there -p 'tcp;ofi_rxm' shows the lesson."}}

# %% [markdown]
# ## Whose queue is full
# shm copies a WRITE itself within fi_writemsg, by CMA, and refuses it only when
# the client lags in emptying its command queue (smr_rma_fast,
# prov/shm/src/smr_rma.c): on some runs only. The client the server prints asks
# for --delivery-complete: a WRITE with FI_DELIVERY_COMPLETE is copied by the
# client and holds one of the server's own tx_attr.size slots until the server's
# CQ read takes the client's answer (1.x, 2.1: smr_do_iov, freed in
# smr_progress_resp; 2.6: smr_cmd_stack, smr_progress_return), so a burst longer
# than that is refused on every run. It costs a round trip per WRITE through the
# client's CPU (at 64 KiB on 2 cores, 10-20% of the Gbps), and a client that
# stops answering keeps its slots; before 2.5 that blocks every later answer too
# (they are taken in order), and no later client's WRITE completes: so it is not
# the default. 1.x's tcp;ofi_rxm refuses when rxm's tx credits run out
# (rxm_ep.c), and a frozen client keeps the credits of its WRITEs (the next
# cell). 2.x's own tcp takes every WRITE (no bound: xnet_alloc_tx) and
# never refuses, and -p 'tcp;ofi_rxm' shows the lesson there. The server prints
# the provider's refusals apart from the posts held back because every context
# of ours was in flight. The printed client asks for pages over 4 KiB
# (SMR_INJECT_SIZE): 1.x's shm sends a smaller WRITE with FI_DELIVERY_COMPLETE in
# segments, one such WRITE per peer at a time (smr_select_proto, sar_status), which
# refuses nearly every post and leaves little of the throughput.

# %% [markdown]
# ## A new endpoint after a failed client
# After a client fails, the server serves the next one on the same endpoint, except
# where the provider keeps, for a client that stopped answering (frozen, or stopped
# with Ctrl-Z), what only fi_close of the endpoint gives back. rxm (tcp;ofi_rxm,
# verbs;ofi_rxm) lends each operation one of tx_attr.size credits until it completes
# (rxm_get_tx_buf, prov/rxm/src/rxm_ep.c), and such a client's WRITEs complete neither
# when its address leaves our AV nor before its process ends: each one leaves us fewer
# credits. shm, with --delivery-complete: a WRITE waits for the client's answer, and the
# client must stay in our AV meanwhile, since fi_av_remove unmaps its region
# (smr_map_del, prov/shm/src/smr_util.c), which our progress reads when the answer
# comes (smr_progress_resp_entry, smr_progress.c; connect.let_go). Closing the endpoint
# discards what is still posted (fi_close, man/fi_endpoint.3.md). So the server then
# closes it and opens a new one at the same address (fi.at_address): the one it printed,
# which the next client was given. Not after every failure: a client whose CONNECT came
# meanwhile reached the old endpoint, and on shm the new one is a region it has not
# mapped. A client gone (Ctrl-C, killed) is no reason: its closed connection fails its
# WRITEs, some late, and each gives its credit back. Nor is a WRITE still out on 2.x's
# tcp, which lends none; what it reads is kept until the endpoint closes, for at most
# connect.HELD_MAX failed clients.

# %% [markdown]
# ## efa-direct: what a WRITE demands of the device alone (-p efa-direct)
# efa's fabric "efa-direct" (chapter 03) turns each call into one work request for the
# device: no emulation, no staging (prov/efa/docs/efa_fabric_comparison.md). It asks of
# us what efa's RDM fabric "efa" would otherwise do for us: a descriptor for every
# buffer (FI_MR_LOCAL, FI_MR_ALLOCATED), a struct fi_context2 per operation
# (FI_CONTEXT2), SENDs within the device's MTU (about 8 KiB), WRITEs of at most 2
# buffers into one remote iov and up to its max_rdma_size (about 1 GiB) in no order, RMA
# inject of 0 bytes only (efa_rma.c), and the target's AV holding the initiator before
# the first WRITE. 04-16, 18 and 19 keep all of that (FABRIC_RULES=efa-direct checks it on
# shm and tcp); in 09-15 the client puts the server's NICs in its AVs before the first
# WRITE (common/engine/multinet.py). None posts a receive per immediate: on a device
# without unsolicited write receive efa-direct demands that (FI_RX_CQ_DATA,
# efa_user_info.c) and lists nothing for FI_RMA here, and -p efa is the way.

# %% [markdown]
# ## Motivation
#     client                                         server
#     register B buffers of 1 GiB
#     CONNECT(magic, 07, address, [(addr, size, key)] x B,
#             page size, seed, page runs, N) ----->  fill the pages from the seed
#                                                    N times: WRITE the next page;
#                                                      -FI_EAGAIN -> pending queue,
#                                                      read the CQ, post from the queue
#                                      <----------   now and then: heartbeat "n done"
#                                      <----------   last WRITE + immediate data N
#     (GPU: wait for the copies)
#     LANDED -------------------------------------->  stop the clock:
#     check every page                               N x page size / elapsed -> Gbps

# %%
import struct
import time

from common import bench, bounds, cli
from common.fabric import connect, memory
from common.engine.opqueue import HEARTBEAT, Connection, OpQueue
from common.fabric import lib
import common.fabric as fi

CHAPTER = 7
CAPS = lib.FI_MSG | lib.FI_RMA
HEADER = struct.Struct("<QQQIH?")  # seed, page size, WRITEs, page runs, buffers,
                                   # --delivery-complete
REGION = struct.Struct("<QQQ")    # remote address, size, key: what a WRITE needs per buffer
LANDED = struct.Struct("<Q")       # client -> server: all the data is in my memory
BURST = 64                         # new WRITEs submitted between two reads of the CQ
BAD_KEY = 0xBAD0_0000  # --bad-key: a key no registration of ours has


# %% [markdown]
# ## Code

# %%
def server(info, args):
    served, backlog, name = 0, [], None  # backlog: CONNECTs that came during another client
    while not args.clients or served < args.clients:
        with fi.Closer() as own:  # the endpoint: opened again, at its address, when renewed
            domain, cq, av, ep = fi.open_endpoint(own, fi.at_address(info, name), shm=False)
            poller = fi.Poller(cq, ep=ep)
            inbox = fi.Inbox(own, domain, ep, fi.max_send(info))
            if name is None:
                name = fi.getname(ep)
                print(f"server address: {name.hex()}")
                print(cli.client_hint(args, name.hex(), LESSON), flush=True)
            held = []  # what a failed client's WRITEs still out read: kept while they may
            while not args.clients or served < args.clients:
                request = connect.next_client(poller, inbox, backlog)
                if request is None:  # a dead client's lock: a new endpoint
                    break
                renew = False
                try:
                    # Contexts to spare: the provider, not us, should be the one to say "full".
                    queue = OpQueue(ep, cq, poller, slots=fi.in_flight(info))
                    with fi.Closer() as client_own:  # what one client needs, released after it
                        client, request = connect.accept(client_own, info, av, domain, ep, poller,
                                                         request, CHAPTER, args.timeout,
                                                         busy=queue.awaiting_answers)
                        serve(Connection(client_own, domain, client, queue, inbox, backlog,
                                         args.timeout), info, request, args, held)
                except (fi.FabricError, TimeoutError, ValueError) as e:  # serve the next one
                    connect.report(served + 1, e)
                    if isinstance(e, connect.Refused):
                        continue  # another chapter's client, told so: not one of --clients
                    # The provider still holds WRITEs to the failed client (rxm's
                    # credits; on shm the WRITEs awaiting its answer, which keep it in
                    # the AV: connect.let_go): only closing the endpoint frees them.
                    # A new one at the same address serves the next client (the cell
                    # "A new endpoint after a failed client"). Not when none is out (a
                    # lying CONNECT), nor for credits lent to a client gone: its closed
                    # connection fails them, late or not (dropped: OpQueue.abandon). A
                    # renewal loses a CONNECT that reached the old endpoint meanwhile.
                    renew = (lends_credits(info) and queue.in_flight() > 0
                             and not connect.gone(e) or queue.awaiting_answers() > 0)
                served += 1
                if renew or len(held) >= connect.HELD_MAX:
                    connect.keep_arrived(poller, inbox, backlog)  # a new endpoint, same address
                    break


def lends_credits(info):
    """Does a failed client leave our endpoint short? rxm (tcp;ofi_rxm, verbs;ofi_rxm) lends
    each operation one of tx_attr.size credits until it completes (rxm_get_tx_buf,
    prov/rxm/src/rxm_ep.c): a frozen client's WRITEs keep theirs until its process ends,
    whether or not its address is still in our AV. Closing the endpoint gives them back."""
    return "ofi_rxm" in fi.provider_of(info)


def serve(conn, info, request, args, held):
    seed, page_size, iters, runs, nbufs, delivery = connect.unpack_from(HEADER, request)
    regions = [connect.unpack_from(REGION, request, HEADER.size + i * REGION.size)
               for i in range(nbufs)]
    pages = connect.unpack_pages(request, HEADER.size + nbufs * REGION.size, runs, page_size)
    if not 1 <= iters < 1 << 32:  # the client's own check (main), made again: a CONNECT lies
        raise ValueError(f"CONNECT asks for {iters} WRITEs: 1..{(1 << 32) - 1} travel as "
                         "32-bit immediate data")
    connect.check_targets(regions, page_size, pages)
    npages = len(pages)

    source = keep = None
    try:
        # The data, generated before anything is timed: page j of the request in slot j.
        def keep_talking():  # this can take seconds: the client must not give up on us
            conn.beat(conn.queue.completed)
            conn.queue.progress()
        source = memory.seeded_source(pages, page_size, seed, args.gpu, each=keep_talking)
        desc = fi.mr_desc(memory.register(conn.own, conn.domain, source, lib.FI_WRITE, key=2000))

        # One WRITE message per page, built once; posting only sets its context.
        messages, keep = connect.write_messages(source, page_size, pages, range(npages),
                                                regions, desc, conn.client)
        flags = lib.FI_COMPLETION | (lib.FI_DELIVERY_COMPLETE if delivery else 0)
        start = write_all(conn, messages, iters, page_size, flags)
        # A WRITE's completion says the source may be reused, not that the data has
        # landed (shm's CUDA IPC copies are still queued on the GPU then): the clock
        # stops when the client says its memory holds everything.
        while len(message := conn.queue.next_message(conn.inbox, conn.timeout)) != LANDED.size:
            conn.backlog.append(message)  # another client's CONNECT: it is served next
        elapsed = time.perf_counter() - start
        connect.check_landed(LANDED.unpack(message)[0], iters)
    except Exception:  # this client failed: let what is in flight finish, then serve the next
        conn.queue.drain(conn.timeout)  # (not on Ctrl-C: opqueue.drain says why)
        if conn.queue.abandon():  # still out (a client stopped): tcp sends them from `source`
            held.append((source, keep, conn))  # as its socket drains, if ever (and its beat)
        raise
    f = bench.figures(iters, page_size, elapsed)
    memory_kind = "host" if args.gpu is None else "cuda"
    here = bench.machine(args.gpu)
    lim = bench.limit(info, args.provider_used, memory_kind, page_size, here)
    if conn.queue.completed != iters:
        raise ValueError(f"{conn.queue.completed} completions for {iters} WRITEs")
    print(f"wrote {npages} pages from {source.kind}, the last WRITE with immediate data {iters}")
    print(f"completions: {conn.queue.completed}, one per WRITE; -FI_EAGAIN "
          f"{conn.queue.eagain} times (the provider's queue full), {conn.queue.full} posts held "
          "back (all our contexts in flight)")
    print(bench.summary(f, lim), flush=True)
    if args.json:
        path = bench.run_path(args.json, "07_queue", args.provider_used, memory_kind, page_size)
        f["refused"] = conn.queue.eagain
        sent = {"seed": seed, "page_size": page_size, "iters": iters,  # in its CONNECT
                "pages": connect.pages_flag(pages), "buffers": nbufs,
                "buffer_size": regions[0][1], "delivery_complete": delivery}
        written = bench.record(path, "07_queue", args, info, memory_kind, here, f, lim, sent,
                               LESSON["field"])
        print(f"result: {written}")


def write_all(conn, messages, iters, page_size, flags):
    """Post `iters` WRITEs (with `flags`) cycling over the pages, wait for their
    completions; returns when the first was posted.

    It posts until posts wait in the queue, reading the CQ only then: a
    provider's slots that only those reads give back run out within one burst
    (shm with FI_DELIVERY_COMPLETE: tx_attr.size; our contexts are four times
    that, fi.in_flight)."""
    progress = bench.Progress("WRITEs completed", iters, page_size)
    queue, timeout = conn.queue, conn.timeout
    start = time.perf_counter()
    submitted = 0
    stalled = bounds.Deadline(timeout, lambda: f"no WRITE completed for {timeout:g} s "
                              f"({queue.completed} of {iters} done): is the client still there?")
    with stalled:  # also when the provider call itself never returns
        while queue.completed < iters:
            # The last WRITE carries the immediate data, once all the others have completed:
            # completions, not posting order, say that a page is there.
            if submitted < iters - 1:
                while submitted < iters - 1 and len(queue.pending) < BURST:
                    queue.write(messages[submitted % len(messages)], flags)
                    submitted += 1
            elif submitted == iters - 1 and queue.completed == iters - 1:
                last = messages[submitted % len(messages)]
                last.data = iters
                queue.write(last, flags | lib.FI_REMOTE_CQ_DATA)
                submitted += 1
            now = time.monotonic()
            if queue.progress():
                stalled.at = now + timeout
            elif now > stalled.at:
                raise TimeoutError(stalled.what())
            if conn.beat(queue.completed):
                progress.update(queue.completed)
    progress.close()
    return start


def client(info, args, addr):
    pages = args.pages
    with fi.Closer() as own:
        domain, cq, av, ep = fi.open_endpoint(own, info, shm=False)
        poller = fi.Poller(cq)
        inbox = fi.Inbox(own, domain, ep, len(connect.REFUSED) + connect.WHY)  # or a heartbeat
        buffers = [memory.Buffer(args.buffer_size, args.gpu) for _ in range(args.buffers)]
        mrs = [memory.register(own, domain, b, memory.WRITE_TARGET, key=i + 1)
               for i, b in enumerate(buffers)]
        print(f"memory: {args.buffers} x {args.buffer_size} bytes of {buffers[0].kind}")
        server_addr = fi.av_insert(av, addr)

        regions = [(fi.remote_base(info, b.ptr), b.size,
                    BAD_KEY if args.bad_key else fi.mr_key(mr)) for b, mr in zip(buffers, mrs)]
        poller.send(own, domain, ep, request(args, fi.getname(ep), regions), server_addr, 1001,
                    args.timeout, "CONNECT", ": is the server running?")

        # One-sided WRITEs leave no trace here; the heartbeats say the server is alive.
        progress = bench.Progress("WRITEs completed (server's count)", args.iters, args.page_size)
        while not poller.remote_data:
            got, length = poller.wait([inbox.ctx], args.timeout, "heartbeat from the server",
                                      or_remote_data=True)
            if got is not None:
                progress.update(HEARTBEAT.unpack(connect.heard(inbox.take(length)))[0])
        progress.close()
        data = poller.remote_data.pop(0)
        memory.synchronize(args.gpu)  # the GPU has finished every copy into our buffers
        poller.send(own, domain, ep, LANDED.pack(data), server_addr, 1002, args.timeout,
                    "LANDED")
        print(f"remote write completion: FI_REMOTE_CQ_DATA, immediate data {data}")
        reached = pages[:args.iters]  # WRITE i goes to page i modulo the pages (write_all)
        wrong = memory.count_wrong(buffers, args.page_size, args.seed, reached)
        print(connect.verified(len(reached), len(pages), len(pages), args.iters, args.page_size,
                               wrong))
        if data != args.iters or wrong:
            raise ValueError(f"{wrong} wrong bytes, immediate data {data} (expected {args.iters})")


def request(args, me, regions):
    """CONNECT: our address `me`, per buffer its (remote address, size, key), the pages
    and how many WRITEs to cycle over them."""
    runs, pages = connect.pack_pages(args.pages)
    return connect.pack(CHAPTER, me, HEADER.pack(args.seed, args.page_size, args.iters, runs,
                                                 len(regions), args.delivery_complete)
                        + b"".join(REGION.pack(*r) for r in regions) + pages)


def main():
    p = cli.parser(__doc__)
    cli.add_peer(p)
    cli.add_pages(p, pages="the first 1000 of each buffer", buffer_size=1 << 30)
    cli.side("client", p.add_argument("--bad-key", action="store_true", help="send a wrong "
                                      "key, to see how a failed WRITE is reported"))
    cli.side("client",
             p.add_argument("--iters", type=int, default=1_000_000,
                            help="WRITEs to post, cycling over the pages (default 1000000)"),
             p.add_argument("--delivery-complete", action="store_true",
                            help="have the server post every WRITE with FI_DELIVERY_COMPLETE: "
                            "on shm its queue is then full, and says so, on every run"))
    cli.side("server", p.add_argument("--json", nargs="?", const="auto", help="write the "
                                      "figures as JSON to this file (default "
                                      "results/runs/07_queue-...json)"))
    args = p.parse_args()
    cli.check_pages(args, lambda per_buffer: [b * per_buffer + i for b in range(args.buffers)
                                              for i in range(min(1000, per_buffer))])
    if not 1 <= args.iters < 1 << 32:
        raise cli.UsageError(f"--iters must be 1..{(1 << 32) - 1}: it travels as 32-bit "
                             "immediate data")
    memory.use_gpu(args.gpu)

    info, addr = cli.peer(args, CAPS, hmem=args.gpu is not None, shm=False)
    mr_mode = fi.tostr(info.domain_attr.mr_mode, lib.FI_TYPE_MR_MODE) or "no mode bits"
    print(f"memory registration: {mr_mode}")
    if addr is None:
        return server(info, args)
    fake = request(args, bytes(connect.ADDRESS_BOUND), [(0, 0, 0)] * args.buffers)
    connect.fits(info, len(fake), "pages or buffers")
    return client(info, args, addr)


if __name__ == "__main__":
    cli.run(main)

"""Chapter 09's engine, shared with the chapters after it: many NICs per GPU.

Each NIC is a "lane": a domain with its endpoint, CQ, AV and op queue. A
control endpoint carries CONNECT, heartbeats and LANDED; the data goes on
G x N lanes, a group's pages round robin over its lanes, one thread visiting
every lane. Which NICs: nics.lane_nics, each GPU's own by chapter 08's topology;
where a host has no NIC, a lane is one more domain of shm or tcp (a "virtual
NIC"). What posts the WRITEs is the chapter's `engine`: chapter 09's loop (one thread
visiting every lane, in chapters/09_multinet.py), worker threads from chapter 11 on; the
flags are flags.py's, the report report.py's.
"""
import struct
import threading
import time
from typing import NamedTuple

from common import bench, bounds, cli
from common.engine.flags import parse
from common.engine.nics import lane_nics
from common.engine.report import report
from common.fabric import connect, memory
from common.fabric import ffi, lib
from common.engine.opqueue import HEARTBEAT, Connection, OpQueue
import common.fabric as fi

CAPS = lib.FI_MSG | lib.FI_RMA
HEADER = struct.Struct("<QQQIHHH")  # seed, page size, WRITEs, page runs, buffers, groups,
REGION = struct.Struct("<QQQ")      # NICs per group | remote addr, size, key
NAME = struct.Struct("<H")  # each address's length before it: shm's ":9:0" and ":10:0" differ
LANDED = struct.Struct("<Q")
INSERTED = b"lanes in AVs"  # client -> server: each of its lanes' AVs holds the server's lane
BURST = 1  # new WRITEs per lane per visit: one, as in the series; chapter 14 posts more


class Clock(NamedTuple):
    """When a run started: wall time and this process's CPU time, read together, so that
    CPU per WRITE covers what the Gbps cover (not the warmup before, which spins on tcp)."""
    wall: float
    cpu: float


def clock():
    return Clock(time.perf_counter(), time.process_time())


class Started(NamedTuple):
    """What an engine returns: when it started the clock (a Clock), its figures for the
    record, and what it prints once the run's time is known (given it: seconds), if
    anything."""
    at: Clock
    figures: dict
    then: object = None


class Lane:
    """One NIC's endpoint, CQ, AV and queue; and, on the server, its share of the WRITEs."""

    def __init__(self, own, info, gpu=None):
        self.info, self.gpu = info, gpu  # gpu: whose memory it carries (None: host)
        self.domain, self.cq, self.av, self.ep = fi.open_endpoint(own, info, shm=False)
        self.poller = fi.Poller(self.cq, ep=self.ep)
        self.queue = OpQueue(self.ep, self.cq, self.poller, slots=fi.in_flight(info))
        self.iters = self.submitted = 0
        self.messages = []

    def post_some(self):
        """Submit up to BURST new WRITEs; the last only once all the others completed."""
        q, last = self.queue, self.iters - 1
        for _ in range(BURST):
            if self.submitted >= last or len(q.pending) >= BURST:
                break
            q.write(self.messages[self.submitted % len(self.messages)])
            self.submitted += 1
        if self.submitted == last and q.completed == last:
            msg = self.messages[last % len(self.messages)]
            msg.data = self.iters  # the immediate: how many WRITEs this NIC carried
            q.write(msg, lib.FI_COMPLETION | lib.FI_REMOTE_CQ_DATA)
            self.submitted += 1


def server(info, args, engine):
    served, backlog, name = 0, [], None
    while not args.clients or served < args.clients:
        with fi.Closer() as own:  # the endpoint: opened again, at its address, when renewed
            control = Lane(own, fi.at_address(info, name))
            inbox = fi.Inbox(own, control.domain, control.ep, fi.max_send(info))
            if name is None:
                name = fi.getname(control.ep)
                print(f"server address: {name.hex()}")
                print(cli.client_hint(args, name.hex(), args.lesson, swap_gpus(args)),
                      flush=True)
            while not args.clients or served < args.clients:
                request = connect.next_client(control.poller, inbox, backlog)
                if request is None:  # a dead client's lock: a new endpoint
                    break
                try:
                    with fi.Closer() as client_own:
                        client, request = connect.accept(client_own, info, control.av,
                                                         control.domain, control.ep,
                                                         control.poller, request, args.number,
                                                         args.timeout)
                        # held past client_own's close: the workers' C arrays (conn.keep)
                        conn = Connection(client_own, control.domain, client, control.queue,
                                          inbox, backlog, args.timeout)
                        serve(conn, info, request, args, engine)
                except (fi.FabricError, TimeoutError, ValueError) as e:
                    connect.report(served + 1, e)
                    if isinstance(e, connect.Refused):
                        continue  # another chapter's client, told so: not one of --clients
                served += 1


def swap_gpus(args):
    """A client for a server on GPUs uses the same ones, each writing to the other's."""
    return ["--gpus", ",".join(map(str, args.gpus[::-1]))] if args.gpus else []


def pack_names(names):
    return b"".join(NAME.pack(len(name)) + name for name in names)


def unpack_names(data, at, count):
    """`count` addresses packed by pack_names from `at` on; and where they end."""
    names = []
    for _ in range(count):
        (length,) = connect.unpack_from(NAME, data, at)
        names.append(data[at + NAME.size:at + NAME.size + length])
        at += NAME.size + length
    return names, at


def serve(conn, head, request, args, engine):
    seed, page_size, iters, runs, nbufs, groups, per_group = connect.unpack_from(HEADER, request)
    own, lanes, started = conn.own, [], False
    try:
        # the whole CONNECT is checked before anything is opened for it (flags.parse's
        # checks, made again: a CONNECT lies)
        if not 1 <= groups <= 64 or not 1 <= per_group <= 64:
            raise ValueError(f"CONNECT names {groups} groups of {per_group} NICs: 1..64 each")
        if not groups * per_group <= iters < 1 << 32:
            raise ValueError(f"CONNECT asks for {iters} WRITEs over {groups * per_group} NICs")
        if args.gpus and len(args.gpus) != groups:
            raise ValueError(f"the client has {groups} groups, this server "
                             f"{len(args.gpus)} GPUs")
        names, at = unpack_names(request, HEADER.size, groups * per_group)
        regions = [connect.unpack_from(REGION, request, at + i * REGION.size)
                   for i in range(groups * per_group * nbufs)]
        pages = connect.unpack_pages(request, at + len(regions) * REGION.size, runs, page_size)
        for k in range(groups * per_group):  # each lane WRITEs into its own nbufs buffers
            connect.check_targets(regions[k * nbufs:(k + 1) * nbufs], page_size, pages)
        infos, what = lane_nics(args, head, groups, per_group)
        print(what, flush=True)
        for g in range(groups):
            for n in range(per_group):
                lane = Lane(own, infos[g][n], args.gpus[g] if args.gpus else None)
                lane.group = g
                lane.peer = fi.av_insert(lane.av, names[len(lanes)], lane.info)
                lanes.append(lane)
        introduce(conn, lanes)

        for lane, count in zip(lanes, lane_iters(iters, len(lanes))):
            lane.iters = count
        def keep_talking():  # generating pages can take seconds: heartbeats meanwhile
            conn.beat(0)
            conn.queue.progress()
        sources = []
        for g in range(groups):
            gpu = args.gpus[g] if args.gpus else None
            source = memory.seeded_source(pages, page_size, seed + g, gpu, each=keep_talking)
            sources.append(source)
            for n in range(per_group):
                k = g * per_group + n
                build_messages(own, lanes[k], source, regions[k * nbufs:(k + 1) * nbufs],
                               pages, page_size, n, per_group)
        started = True
        this_run = engine(args, lanes, conn, page_size)
        while len(message := conn.queue.next_message(conn.inbox, conn.timeout)) != LANDED.size:
            conn.backlog.append(message)
        elapsed = time.perf_counter() - this_run.at.wall
        cpu = time.process_time() - this_run.at.cpu
        connect.check_landed(LANDED.unpack(message)[0], iters)
    except Exception as e:  # this client failed (not Ctrl-C: opqueue.drain says why)
        # one timeout for them all, not one each: the next client's CONNECT waits meanwhile
        deadline = time.monotonic() + conn.timeout
        for queue in [lane.queue for lane in lanes] + [conn.queue]:
            queue.drain(max(0.0, deadline - time.monotonic()))
        if not started and isinstance(e, (fi.FabricError, ValueError)):
            connect.refuse(own, conn.domain, conn.queue.ep, conn.queue.poller, conn.client, e,
                           conn.timeout)
        raise
    sent = {"seed": seed, "page_size": page_size, "iters": iters,  # in its CONNECT
            "pages": connect.pages_flag(pages), "buffers": nbufs,
            "buffer_size": regions[0][1], "groups": groups, "nics_per_gpu": per_group}
    report(args, lanes, sources, iters, page_size, elapsed, cpu, sent, this_run.figures)
    if this_run.then:
        this_run.then(elapsed)


# The client's lanes are the targets of the server's WRITEs, and efa-direct's device takes
# an RMA only from an initiator already in the target's AV ("Peer AV entry on the RMA
# target side", prov/efa/docs/efa_fabric_comparison.md). So the server answers CONNECT
# with its lanes' addresses, the client puts each in the AV of the lane it writes to and
# says so, and only then does the server write. Every provider takes the step: one round
# trip per client, before the clock, and the AVs of efa's RDM fabric need it as well once
# FI_OPT_EFA_HOMOGENEOUS_PEERS skips its handshake (the same page).
def introduce(conn, lanes):
    """Send the client our lanes' addresses; return once it has them in its AVs.
    Another client's CONNECT, come meanwhile, waits in the backlog."""
    conn.queue.poller.send(conn.own, conn.domain, conn.queue.ep,
                           pack_names([fi.getname(lane.ep) for lane in lanes]), conn.client,
                           1004, conn.timeout, "lane addresses")
    while (message := conn.queue.next_message(conn.inbox, conn.timeout, "our lanes in its AVs")
           ) != INSERTED:
        conn.backlog.append(message)


def insert_lanes(own, control, inbox, lanes, server, timeout):
    """The server's answer to CONNECT (or its refusal): its lanes' addresses, each put in
    the AV of our lane it writes to; then the server is told that it may write."""
    _, length = control.poller.wait([inbox.ctx], timeout, "lane addresses from the server")
    message = connect.heard(inbox.take(length))
    try:
        names, end = unpack_names(message, 0, len(lanes))
    except struct.error:
        end = None
    if end != len(message):
        raise ValueError(f"the server's answer to CONNECT is not {len(lanes)} lane addresses")
    for lane, name in zip(lanes, names):
        fi.av_insert(lane.av, name)
    control.poller.send(own, control.domain, control.ep, INSERTED, server, 1004, timeout,
                        "word of the lanes in our AVs")


def build_messages(own, lane, source, regions, pages, page_size, n, per_group):
    """This lane's WRITE messages: pages n, n + N, n + 2N, ... of its group, with the
    source registered on this lane's domain and the client's keys for this NIC."""
    desc = fi.mr_desc(memory.register(own, lane.domain, source, lib.FI_WRITE, key=2000))
    lane.messages, lane.keep = connect.write_messages(source, page_size, pages,
                                                      lane_pages(n, per_group, len(pages)),
                                                      regions, desc, lane.peer)


def lane_iters(iters, lanes):
    """WRITEs per lane, as even as they come."""
    return [iters // lanes + (k < iters % lanes) for k in range(lanes)]


def lane_pages(n, per_group, npages):
    """Which of its group's pages (indexes into the page list) lane n writes, cycling."""
    return list(range(n, npages, per_group)) or [n % npages]


def written(pages, iters, groups, per_group):
    """Per group, the pages its lanes' WRITEs reach (both sides compute it): each lane
    cycles over its lane_pages, so with fewer WRITEs than pages it reaches the first ones."""
    counts = lane_iters(iters, groups * per_group)
    reached = []
    for g in range(groups):
        mine = set()  # indexes into `pages`: two lanes may share one where pages are few
        for n in range(per_group):
            mine.update(lane_pages(n, per_group, len(pages))[:counts[g * per_group + n]])
        reached.append([pages[j] for j in sorted(mine)])
    return reached


def client(info, args, addr, infos):
    groups, per_group = len(infos), len(infos[0])
    with fi.Closer() as own:
        control = Lane(own, info)
        # the server's lane addresses: no more than CONNECT's own (connect.fits in run)
        inbox = fi.Inbox(own, control.domain, control.ep, fi.max_send(info))
        server_addr = fi.av_insert(control.av, addr)
        lanes = [Lane(own, i, args.gpus[g] if args.gpus else None)
                 for g, group in enumerate(infos) for i in group]
        buffers = [[memory.Buffer(args.buffer_size, args.gpus[g] if args.gpus else None)
                    for _ in range(args.buffers)] for g in range(groups)]
        regions = b""
        for k, lane in enumerate(lanes):  # every buffer of the group, on each of its NICs
            for i, b in enumerate(buffers[k // per_group]):
                mr = memory.register(own, lane.domain, b, memory.WRITE_TARGET, key=i + 1)
                regions += REGION.pack(fi.remote_base(lane.info, b.ptr), b.size, fi.mr_key(mr))
        print(f"memory: {groups} x {args.buffers} x {args.buffer_size} bytes of "
              f"{' / '.join(sorted({bs[0].kind for bs in buffers}))}")
        control.poller.send(own, control.domain, control.ep,
                            request(args, fi.getname(control.ep),
                                    [fi.getname(lane.ep) for lane in lanes], regions),
                            server_addr, 1001, args.timeout, "CONNECT", ": is the server running?")
        insert_lanes(own, control, inbox, lanes, server_addr, args.timeout)
        data = wait_immediates(control, inbox, lanes, args)
        for bs in buffers:
            memory.synchronize(bs[0].gpu)
        control.poller.send(own, control.domain, control.ep, LANDED.pack(sum(data)),
                            server_addr, 1002, args.timeout, "LANDED")
        print(f"immediate data from {len(lanes)} NICs, one each: {' '.join(map(str, data))}")
        reached = written(args.pages, args.iters, groups, per_group)
        wrong = [memory.count_wrong(bs, args.page_size, args.seed + g, reached[g])
                 for g, bs in enumerate(buffers)]
        asked = f"{groups} x {len(args.pages)}"
        print(connect.verified(sum(map(len, reached)), asked, groups * len(args.pages),
                               args.iters, args.page_size, sum(wrong)))
        if sum(data) != args.iters or sum(wrong):
            raise ValueError(f"{sum(wrong)} wrong bytes, immediates add up to {sum(data)} "
                             f"(expected {args.iters})")


def wait_immediates(control, inbox, lanes, args):
    """One immediate per lane, waited for by one thread per group in C (GIL released):
    on shm the receiver's CQ reads are what copy the data in, so they must keep up
    with the writer. This thread reads the heartbeats that keep the wait alive."""
    progress = bench.Progress("WRITEs completed (server's count)", args.iters, args.page_size)
    per_group = len(lanes) // len(args.gpus or [None] * args.groups)
    data, got = ffi.new("uint64_t[]", len(lanes)), ffi.new("uint8_t[]", len(lanes))
    stop, errors = ffi.new("int *"), []

    def wait(first):
        mine = lanes[first:first + per_group]
        memory.current(mine[0].gpu)  # shm copies into this group's GPU from this thread
        cqs, failed = ffi.new("struct fid_cq *[]", [lane.cq for lane in mine]), ffi.new("size_t *")
        rc = lib.tut_wait_data(cqs, len(mine), data + first, got + first, stop, failed)
        if rc < 0:
            errors.append(fi.native_error(rc, mine[failed[0]].cq, "fi_cq_read (tut_wait_data)"))
    threads = [threading.Thread(target=wait, args=(first,), name=f"the waiter of NIC {first}")
               for first in range(0, len(lanes), per_group)]
    deadline = time.monotonic() + args.timeout
    try:  # a Ctrl-C while they start must stop those started: their CQs close next
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and not errors:
            control.poller.poll()
            if fi.key(inbox.ctx) in control.poller.done:
                message = inbox.take(control.poller.done.pop(fi.key(inbox.ctx)))
                progress.update(HEARTBEAT.unpack(connect.heard(message))[0])
                deadline = time.monotonic() + args.timeout
            elif time.monotonic() > deadline:
                raise TimeoutError(f"no heartbeat from the server within {args.timeout:g} s "
                                   f"({sum(got[0:len(lanes)])} of {len(lanes)} NICs done)")
            time.sleep(0.001)  # the waiting threads do the work; this one only listens
    finally:
        stop[0] = 1
        bounds.join(threads, "the threads waiting for immediate data")
        progress.close()
    if errors:
        raise errors[0]
    return list(data[0:len(lanes)])


def request(args, me, names, regions):
    """CONNECT: the control endpoint's address `me`, each lane's (`names`), and the packed
    `regions` (per lane, per buffer: remote address, size, key); the pages and WRITEs."""
    runs, pages = connect.pack_pages(args.pages)
    return connect.pack(args.number, me,
                        HEADER.pack(args.seed, args.page_size, args.iters, runs, args.buffers,
                                    args.groups, len(names) // args.groups)
                        + pack_names(names) + regions + pages)


def run(doc, chapter, engine, add_args=None, lesson=None):
    """A chapter's main(): server or client, as chapter 09 shows them. `engine` is what
    posts the server's WRITEs (engine(args, lanes, conn, page_size), returning Started);
    `add_args` the chapter's own flags; `lesson` its LESSON, whose client run the server
    prints as the client command."""
    args = parse(doc, add_args)
    args.chapter, args.number, args.lesson = chapter, int(chapter[:2]), lesson
    info, addr = cli.peer(args, CAPS, hmem=bool(args.gpus), shm=False)
    if addr is None:
        return server(info, args, engine)
    infos, what = lane_nics(args, info, args.groups, args.nics_per_gpu)  # before opening
    print(what)
    lanes, name = args.groups * len(infos[0]), bytes(connect.ADDRESS_BOUND)
    fake = request(args, name, [name] * lanes, bytes(REGION.size * lanes * args.buffers))
    connect.fits(info, len(fake), "pages, buffers or NICs")
    return client(info, args, addr, infos)

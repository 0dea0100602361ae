"""Chapter 11's worker threads, shared by 11-15: one per GPU, each running its chapter's C loop.

Chapters 12-15 change where a worker runs and
what its C loop does, not how Python starts, watches and stops the workers,
which is here. Each chapter's C module (common._nativeNN, built from
chapters/NN_name.c) has a `struct lane` (one NIC: endpoint, CQ, WRITE
messages, and the bookkeeping of what is in flight) and a `worker()` that
runs one group's lanes until they are done, `*stop` is set, or a call fails.
"""
import threading
import time

from common import bench, bounds
from common.engine.multinet import Started, clock
import common.fabric as fi


def by_group(lanes):
    groups = {}
    for lane in lanes:
        groups.setdefault(lane.group, []).append(lane)
    return list(groups.values())


def lane_array(native, mine):
    """(struct lane[], what it points to) for one group's lanes, with room for every WRITE
    they may have in flight. Zero-filled here, so the memory is first touched by the
    calling thread: chapter 12 calls this from the pinned worker itself."""
    new, keep = native.ffi.new, []
    array = new("struct lane[]", len(mine))
    for w, lane in zip(array, mine):
        slots = fi.in_flight(lane.info)
        keep += [new("struct fi_context2[]", slots), new("uint8_t[]", slots),
                 new("size_t[]", list(range(slots))), new("size_t[]", slots)]
        w.contexts, w.busy, w.free_slots, w.pending = keep[-4:]
        w.nfree = w.nslots = w.pend_cap = slots
        w.ep, w.cq, w.iters = lane.ep, lane.cq, lane.iters
        w.sq_size = lane.info.tx_attr.size  # what a batch with FI_MORE must fit (lane.h)
        w.msgs, w.nmsgs = lane.messages[0], len(lane.messages)
    return array, keep + [array]


def call(native, mine, errors, kept, *args):
    """Run `native.lib.worker(lanes, nlanes, *args, &failed)` on a group's lanes (the GIL is
    released for the call), then copy its counts back for the report. Errors go to
    `errors`; the C arrays to `kept`, alive until the endpoints close: a WRITE still in
    flight after a failure owns its context. The chapters keep them on the Connection
    (conn.keep), which the server holds until its next client."""
    array, keep = lane_array(native, mine)
    kept.append(keep)
    failed = native.ffi.new("int *")
    rc = native.lib.worker(array, len(mine), *args, failed)
    for w, lane in zip(array, mine):
        lane.queue.completed, lane.queue.eagain = w.completed, w.eagain
    if rc == -fi.lib.FI_EOTHER:
        errors.append(ValueError("a completion for no WRITE in flight"))
    elif rc:
        errors.append(fi.native_error(rc, mine[failed[0]].cq, "fi_writemsg/fi_cq_read (worker)"))


def run(threads, lanes, conn, page_size, done, halt, errors):
    """Start the workers; meanwhile this thread sends heartbeats, watches `done()` (WRITEs
    completed so far) for a stall and, on any failure, calls `halt()` and waits for the
    workers to stop. Returns multinet.Started."""
    timeout, total = conn.timeout, sum(lane.iters for lane in lanes)
    progress = bench.Progress("WRITEs completed", total, page_size)
    start = clock()
    last = looked = start.wall
    seen = 0
    try:  # a Ctrl-C while they start must stop those started: their CQs close next
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads) and not errors:
            conn.queue.progress()
            now, finished = time.perf_counter(), done()
            if now - looked > bounds.PAUSED:  # this process was stopped (Ctrl-Z, a debugger):
                last += now - looked          # that time is not the peer's stall
            looked = now
            if finished != seen:
                seen, last = finished, now
            elif now - last > timeout:
                raise TimeoutError(f"no WRITE completed for {timeout:g} s ({finished} of "
                                   f"{total} done): is the client still there?")
            if conn.beat(finished):
                progress.update(finished)
            time.sleep(0.0005)  # the workers do the work; this thread only watches
    finally:
        halt()
        bounds.join(threads, "the workers")
        progress.close()
    if errors:
        raise errors[0]
    return Started(start, {"workers": len(threads)})


def threads_for(lanes, work, errors):
    """One thread per group of lanes, each running work(k, its lanes); what it raises
    goes to `errors`, for the main thread to say in one line."""
    def guarded(k, mine):
        try:
            work(k, mine)
        except Exception as e:
            errors.append(e)
    return [threading.Thread(target=guarded, args=(k, mine), name=f"worker {k}")
            for k, mine in enumerate(by_group(lanes))]

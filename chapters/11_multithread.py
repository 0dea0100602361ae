"""Chapter 11 - multithread: one worker thread per GPU, its loop in C so the threads really run.

What you will learn: in chapters 09-10 one thread visits every NIC. The
series gave each GPU a thread of its own, polling that GPU's NICs and posting
its WRITEs; the count of completed WRITEs, shared by all, became an atomic.
In Python there is a catch: the GIL lets one thread run Python code at a
time, so Python threads running a per-WRITE loop take turns instead of
working side by side (--engine python shows it). The fix is to move the
worker's loop into C (chapters/11_multithread.c, through cffi, which releases
the GIL during the call): then each thread is a real, parallel worker, and
Python only starts them, watches the shared counter and sends heartbeats.

New since chapter 10 (whose warmup it keeps): the engine. One thread per group (GPU) of lanes; the
loop of common/multinet.py rewritten in C (w11_worker: submit, pending ring,
reap, immediate on each NIC's last WRITE); a shared atomic counter;
--engine python|native.

    python chapters/11_multithread.py                                  # server
    python chapters/11_multithread.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/11_multithread.py --engine python                  # server, GIL-bound

Transcripts (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
2 groups x 2 virtual NICs, 4 KiB pages so that the cost per WRITE shows). Python
threads, which take turns on the GIL (chapter 10, one thread: 0.186 Mpps):

    $ python chapters/11_multithread.py -p shm --clients 1 --engine python
    provider: shm (asked for), domain shm
    server address: 66695f73686d3a2f2f33313835323a303a3000
    run the client: python chapters/11_multithread.py -p shm 66695f73686d3a2f2f33313835323a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 0.117 ms on average, 0.276 ms at most (4 NICs)
    2 python worker threads, one per GPU
    wrote from 2 x host memory; WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 8 times
    400000 WRITEs of 4096 bytes in 3.166 s: 4.139 Gbps, 0.126 Mpps (28.0% of 14.802 Gbps, fi_rma_bw here (results/baselines/vm-2core-shm-host.json))
    first contact vs steady state: 0.276 ms vs 31.7 us per WRITE per NIC (9x)

    $ python chapters/11_multithread.py -p shm 66695f73686d3a2f2f33313835323a303a3000 --groups 2 --nics-per-gpu 2 --iters 400000 --page-size 4K --buffer-size 1M --pages 0-63
    provider: shm (asked for), domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 100000 100000 100000 100000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes

The same with the worker loop in C, the GIL released:

    $ python chapters/11_multithread.py -p shm --clients 1
    provider: shm (asked for), domain shm
    server address: 66695f73686d3a2f2f33313836323a303a3000
    run the client: python chapters/11_multithread.py -p shm 66695f73686d3a2f2f33313836323a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 0.058 ms on average, 0.103 ms at most (4 NICs)
    2 native worker threads, one per GPU
    wrote from 2 x host memory; WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 9585159 times
    400000 WRITEs of 4096 bytes in 0.745 s: 17.584 Gbps, 0.537 Mpps (118.8% of 14.802 Gbps, fi_rma_bw here (results/baselines/vm-2core-shm-host.json))
    first contact vs steady state: 0.103 ms vs 7.5 us per WRITE per NIC (14x)

    $ python chapters/11_multithread.py -p shm 66695f73686d3a2f2f33313836323a303a3000 --groups 2 --nics-per-gpu 2 --iters 400000 --page-size 4K --buffer-size 1M --pages 0-63
    provider: shm (asked for), domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 100000 100000 100000 100000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes
"""
# %% [markdown]
# ## Motivation
#     main thread: heartbeats, stall check, LANDED       (Python)
#     worker g, for each of its lanes: post WRITEs, read CQ, atomic total += done
#                                                      (C, GIL released; or Python)

# %%
import threading
import time

from common import bench, cli, multinet
from common._native11 import ffi, lib as native
from common.warmup import warm_up
import common.fabric as fi


# %% [markdown]
# ## Code

# %%
def by_group(lanes):
    groups = {}
    for lane in lanes:
        groups.setdefault(lane.group, []).append(lane)
    return list(groups.values())


def python_workers(lanes, total, lock, stop, errors):
    """One Python thread per group: the loop of chapter 09 over that group's lanes."""
    def work(mine):
        try:
            busy = list(mine)
            while busy and not stop.is_set():
                for lane in busy:
                    lane.post_some()
                    done = lane.queue.progress()
                    if done:
                        with lock:  # the shared counter: one thread at a time
                            total[0] += done
                busy = [lane for lane in busy if lane.queue.completed < lane.iters]
        except Exception as e:  # handed to the main thread, which says it in one line
            errors.append(e)
    return [threading.Thread(target=work, args=(mine,)) for mine in by_group(lanes)]


def native_workers(lanes, control, total, stop, errors):
    """One thread per group, each inside w11_worker (C) for the whole run."""
    keep = []  # C arrays, alive as long as the lanes they describe
    structs = []
    for mine in by_group(lanes):
        array = ffi.new("struct w11_lane[]", len(mine))
        for w, lane in zip(array, mine):
            slots = 4 * lane.info.tx_attr.size + 64
            w.ep, w.cq, w.iters = lane.ep, lane.cq, lane.iters
            w.msgs, w.nmsgs = lane.messages[0], len(lane.messages)
            w.contexts = keep_new(keep, "struct fi_context2[]", slots)
            w.busy = keep_new(keep, "uint8_t[]", slots)
            w.free_slots = keep_new(keep, "size_t[]", list(range(slots)))
            w.nfree = w.nslots = slots
            w.pending = keep_new(keep, "size_t[]", slots)
            w.pend_cap = slots
        structs.append((array, mine))
    control.keep = (keep, structs, total, stop)  # until the next client: endpoints close first

    def work(array, mine):
        failed = ffi.new("int *")
        rc = native.w11_worker(array, len(mine), total, stop, failed)  # GIL released
        if rc:
            errors.append(native_error(rc, mine[failed[0]]))
    return [threading.Thread(target=work, args=s) for s in structs], structs


def keep_new(keep, ctype, init):
    keep.append(ffi.new(ctype, init))
    return keep[-1]


def native_error(rc, lane):
    if rc == -fi.lib.FI_EAVAIL:  # a failed WRITE: its entry and the provider's text
        try:
            fi.cq_read(lane.cq, fi.cq_entries(1))
        except fi.FabricError as e:
            return e
    if rc == -fi.lib.FI_EOTHER:
        return ValueError("a completion for no WRITE in flight")
    return fi.FabricError("fi_writemsg/fi_cq_read (in w11_worker)", rc)


def threaded(args, lanes, control, beat, page_size, timeout):
    """Start one worker per group; the main thread keeps the control endpoint going."""
    total_ops = sum(lane.iters for lane in lanes)
    progress = bench.Progress("WRITEs completed", total_ops, page_size)
    errors = []
    if args.engine == "python":
        total, lock, stop = [0], threading.Lock(), threading.Event()
        threads = python_workers(lanes, total, lock, stop, errors)
        halt = stop.set
    else:
        total, stop = ffi.new("uint64_t *"), ffi.new("int *")
        threads, structs = native_workers(lanes, control, total, stop, errors)
        halt = lambda: stop.__setitem__(0, 1)  # noqa: E731 (the workers read it atomically)
    print(f"{len(threads)} {args.engine} worker threads, one per GPU", flush=True)
    start = last = time.perf_counter()
    seen = 0
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads) and not errors:
            control.queue.progress()
            now, done = time.perf_counter(), total[0]
            if done != seen:
                seen, last = done, now
            elif now - last > timeout:
                raise TimeoutError(f"no WRITE completed for {timeout:g} s ({done} of "
                                   f"{total_ops} done): is the client still there?")
            if beat.maybe(control.queue, done):
                progress.update(done)
            time.sleep(0.0005)  # the workers do the work; this thread only watches
    finally:
        halt()
        for t in threads:
            t.join()
        progress.close()
    if errors:
        raise errors[0]
    if args.engine == "native":  # the counts, for the report
        for array, mine in structs:
            for w, lane in zip(array, mine):
                lane.queue.completed, lane.queue.eagain = w.completed, w.eagain
    return start


def add_args(p):
    p.add_argument("--engine", choices=["native", "python"], default="native",
                   help="server: workers in C, GIL released (default), or in Python")


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "11_multithread", warm_up, threaded, add_args))

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

New since chapter 10 (whose warmup it keeps): the engine. One thread per
group (GPU) of lanes; the loop of common/multinet.py rewritten in C: a visit
to a lane in chapters/11_multithread.c, the moves it makes (submit, pending
ring, reap, immediate on each NIC's last WRITE) in common/lane.h; a shared
atomic counter; --engine python|native. Python's side of the workers
(start, watch, stop) is common/workers.py. Chapters 12-15 share both.

    python chapters/11_multithread.py                                  # server
    python chapters/11_multithread.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/11_multithread.py --engine python                  # server, GIL-bound

Transcripts (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
2 groups x 2 virtual NICs, 4 KiB pages so that the cost per WRITE shows). Python
threads, which take turns on the GIL (chapter 10, one thread: 0.186 Mpps):

    $ python chapters/11_multithread.py -p shm --clients 1 --engine python
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f32373836373a303a3000
    run the client: python chapters/11_multithread.py -p shm 66695f73686d3a2f2f32373836373a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 1.740 ms on average, 3.955 ms at most (4 NICs)
    2 python worker threads, one per GPU
    wrote from 2 x host memory; WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 3650 times
    400000 WRITEs of 4096 bytes in 2.174 s: 6.030 Gbps, 0.184 Mpps (40.7% of 14.802 Gbps, fi_rma_bw here (results/baselines/vm-2core-shm-host.json))
    first contact vs steady state: 3.955 ms vs 21.7 us per WRITE per NIC (182x)

    $ python chapters/11_multithread.py 66695f73686d3a2f2f32373836373a303a3000 -p shm --groups 2 --nics-per-gpu 2 --iters 400000 --page-size 4K --buffer-size 1M --pages 0-63
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 100000 100000 100000 100000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes

The same with the worker loop in C, the GIL released:

    $ python chapters/11_multithread.py -p shm --clients 1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f32373838303a303a3000
    run the client: python chapters/11_multithread.py -p shm 66695f73686d3a2f2f32373838303a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 2.049 ms on average, 3.991 ms at most (4 NICs)
    2 native worker threads, one per GPU
    wrote from 2 x host memory; WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 1820882 times
    400000 WRITEs of 4096 bytes in 0.660 s: 19.864 Gbps, 0.606 Mpps (134.2% of 14.802 Gbps, fi_rma_bw here (results/baselines/vm-2core-shm-host.json))
    first contact vs steady state: 3.991 ms vs 6.6 us per WRITE per NIC (605x)

    $ python chapters/11_multithread.py 66695f73686d3a2f2f32373838303a303a3000 -p shm --groups 2 --nics-per-gpu 2 --iters 400000 --page-size 4K --buffer-size 1M --pages 0-63
    provider: shm (asked for), fabric shm, domain shm
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

from common import cli, memory, multinet, workers
import common._native11 as native
from common.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    """One worker per group; the main thread keeps the control endpoint going."""
    errors, control.keep = [], []
    if args.engine == "python":
        total, lock, stop = [0], threading.Lock(), threading.Event()
        halt = stop.set

        def work(k, mine):  # the loop of chapter 09 over this group's lanes
            memory.current(mine[0].gpu)  # the thread's GPU, once (common/memory.py says why)
            busy = list(mine)
            while busy and not stop.is_set():
                for lane in busy:
                    lane.post_some()
                    done = lane.queue.progress()
                    if done:
                        with lock:  # the shared counter: one thread at a time
                            total[0] += done
                busy = [lane for lane in busy if lane.queue.completed < lane.iters]
    else:
        total, stop = native.ffi.new("uint64_t *"), native.ffi.new("int *")
        halt = lambda: stop.__setitem__(0, 1)  # noqa: E731 (the workers read it atomically)

        def work(k, mine):  # the same loop in C; it adds to `total` atomically
            memory.current(mine[0].gpu)
            workers.call(native, mine, errors, control.keep, total, stop)

    threads = workers.threads_for(lanes, work, errors)
    print(f"{len(threads)} {args.engine} worker threads, one per GPU", flush=True)
    return workers.run(threads, lanes, control, beat, page_size, timeout, lambda: total[0],
                       halt, errors)


def add_args(p):
    p.add_argument("--engine", choices=["native", "python"], default="native",
                   help="server: workers in C, GIL released (default), or in Python")


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "11_multithread", warm_up, threaded, add_args))

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
group (GPU) of lanes; the loop of common/engine/multinet.py rewritten in C: a visit
to a lane in chapters/11_multithread.c, the moves it makes (submit, pending
ring, reap, immediate on each NIC's last WRITE) in common/engine/lane.h; a shared
atomic counter; --engine python|native. Python's side of the workers
(start, watch, stop) is common/engine/workers.py. Chapters 12-15 share both.

    .venv/bin/python chapters/11_multithread.py                                  # server
    .venv/bin/python chapters/11_multithread.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/11_multithread.py --engine python                  # server, GIL-bound

Transcripts (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
2 groups x 2 virtual NICs, 4 KiB pages so that the cost per WRITE shows; commit b8a72b4,
another test suite running beside it, load average 3.4). Python threads, which take turns
on the GIL, spend 6.36 us of CPU per WRITE; the loop in C below, 2.09 (the figure
scripts/tour.py compares, since the Gbps of a busy 2-core machine is noise):

    $ .venv/bin/python chapters/11_multithread.py -p shm --clients 1 --engine python
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f31383730373a303a3000
    run the client: .venv/bin/python chapters/11_multithread.py -p shm 66695f73686d3a2f2f31383730373a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 1.631 ms on average, 3.668 ms at most (4 NICs)
    2 python worker threads, one per GPU
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 1306 times
    100000 WRITEs of 4096 bytes in 0.715 s: 4.586 Gbps, 0.140 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 4096)
    CPU time: 6.36 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 1.631 ms vs 10.1 us on average, each a WRITE alone on its NIC (161x); unwarmed, the slowest first contact would have added 1% to this run

    $ .venv/bin/python chapters/11_multithread.py -p shm 66695f73686d3a2f2f31383730373a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes

The same with the worker loop in C, the GIL released:

    $ .venv/bin/python chapters/11_multithread.py -p shm --clients 1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f31383735393a303a3000
    run the client: .venv/bin/python chapters/11_multithread.py -p shm 66695f73686d3a2f2f31383735393a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 1.272 ms on average, 2.144 ms at most (4 NICs)
    2 native worker threads, one per GPU
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 16183 times
    100000 WRITEs of 4096 bytes in 0.296 s: 11.078 Gbps, 0.338 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 4096)
    CPU time: 2.09 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 1.272 ms vs 7.7 us on average, each a WRITE alone on its NIC (164x); unwarmed, the slowest first contact would have added 1% to this run

    $ .venv/bin/python chapters/11_multithread.py -p shm 66695f73686d3a2f2f31383735393a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "CPU per WRITE", "visible": {"than": "11 --engine python", "by": 1.5},
          "field": "cpu_us_per_write",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000"}

# %% [markdown]
# ## Motivation
#     main thread: heartbeats, stall check, LANDED       (Python)
#     worker g, for each of its lanes: post WRITEs, read CQ, atomic total += done
#                                                      (C, GIL released; or Python)

# %%
import threading

from common import cli
from common.engine import multinet, workers
from common.fabric import memory
import common._native11 as native
from common.engine.warmup import warm_up


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
            memory.current(mine[0].gpu)  # the thread's GPU, once (common/fabric/memory.py says why)
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
    cli.side("server", p.add_argument("--engine", choices=["native", "python"],
                                      default="native", help="workers in C, GIL released "
                                      "(default), or in Python"))


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "11_multithread", warm_up, threaded, add_args, LESSON))

"""Chapter 12 - pin: each GPU's worker thread on a core of its own, next to its GPU.

What you will learn: a thread the scheduler is free to move pays for it on
every move (cold caches; on a two-socket machine, memory and NICs on the
other NUMA node). The series pinned each GPU's thread to the core chapter 08
picked for that GPU, and went from 11% to 39% of 3200 Gbps: the biggest
single step of the series. Two details matter: pin the thread itself, not
the process (os.sched_setaffinity(0, ...) from inside the thread), and
allocate what the thread uses after pinning, because Linux places a page on
the NUMA node of the core that first touches it. One socket and an idle
scheduler leave little to win (LESSON says why).

New since chapter 11: each worker pins itself (topo.worker_cores: chapter
08's core per GPU; with host memory, an even share of the physical cores),
then allocates its lanes' bookkeeping, then runs the same C loop
(chapters/12_pin.c differs from 11's only in its comment). The Python engine
of chapter 11 made its point and is gone.

    .venv/bin/python chapters/12_pin.py                                     # server
    .venv/bin/python chapters/12_pin.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/12_pin.py --gpus 0,1                          # server, GPUs 0 and 1

Transcript and figures (a 2-core VM; 2 x H200): results/12_pin/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "CPU per WRITE", "visible": {"than": "11", "by": 1.2},
          "field": "cpu_us_per_write",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000",
          "why_not": {"shm": "With one NUMA node and two cores that the client shares, a "
                             "pinned worker has nowhere better to be: the series' step needs "
                             "a socket's worth of cores per GPU and two sockets.",
                      "tcp": "One NUMA node and two cores, shared with the client and with "
                             "the kernel's TCP work: a pinned worker has nowhere better to "
                             "be (within 10% of chapter 11's CPU per WRITE, 13 repeats on "
                             "a 2-core VM)."}}

# %% [markdown]
# ## Motivation
#     worker g: sched_setaffinity(this thread, core of GPU g)   <- new
#               allocate its lanes' contexts and rings            <- now after pinning
#               run the C loop of chapter 11 (GIL released)

# %%
import os

from common import cli
from common.engine import multinet, topo, workers
from common.fabric import memory
import common._native12 as native
from common.engine.warmup import warmed


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, conn, page_size):
    cores = topo.worker_cores(args.gpus, len(workers.by_group(lanes)))
    errors, conn.keep = [], []
    total, stop = native.ffi.new("uint64_t *"), native.ffi.new("int *")

    def work(k, mine):  # chapter 11's native worker, pinned: move, then allocate, then run
        os.sched_setaffinity(0, {cores[k]})  # 0: the calling thread only, on Linux
        memory.current(mine[0].gpu)
        workers.call(native, mine, errors, conn.keep, total, stop)  # allocates, runs

    threads = workers.threads_for(lanes, work, errors)
    print(f"{len(threads)} native worker threads, one per GPU, pinned to cores "
          f"{' '.join(map(str, cores))}", flush=True)
    return workers.run(threads, lanes, conn, page_size, lambda: total[0],
                       lambda: stop.__setitem__(0, 1), errors)


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "12_pin", warmed(threaded), lesson=LESSON))

"""Chapter 13's workers, shared by 13-15: pinned, and each counting on a cache line of its own.

Each worker pins itself to its GPU's core (chapter 12), then allocates its
lanes and its counter (struct counter, padded so that no other variable
shares its cache line), then runs its chapter's C worker. Nothing a worker
writes is written by another thread; the main thread only reads the
counters, and adds them up for the heartbeats and the stall check.
"""
import os

from common.engine import topo, workers
from common.fabric import memory


def run(native, gpus, lanes, conn, page_size, *before, say=""):
    """Run native.lib.worker(lanes, nlanes, *before, counter, stop, &failed) in one pinned
    thread per group; returns the start time. `say`: what the chapter adds to the line
    that describes the workers."""
    cores = topo.worker_cores(gpus, len(workers.by_group(lanes)))
    errors, conn.keep = [], []
    counters, stop = [None] * len(cores), native.ffi.new("int *")

    def work(k, mine):
        os.sched_setaffinity(0, {cores[k]})  # 0: the calling thread only, on Linux
        memory.current(mine[0].gpu)
        counters[k] = native.ffi.new("struct counter *")  # its own, allocated after pinning
        workers.call(native, mine, errors, conn.keep, *before, counters[k], stop)

    threads = workers.threads_for(lanes, work, errors)
    print(f"{len(threads)} native worker threads, one per GPU, pinned to cores "
          f"{' '.join(map(str, cores))}, a counter each{say}", flush=True)
    done = lambda: sum(c.value for c in counters if c is not None)  # noqa: E731
    return workers.run(threads, lanes, conn, page_size, done, lambda: stop.__setitem__(0, 1),
                       errors)

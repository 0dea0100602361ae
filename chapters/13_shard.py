"""Chapter 13 - shard: each worker counts on its own cache line; nothing shared is written.

What you will learn: after pinning, the workers of chapter 12 still share one
thing they all write: the atomic count of completed WRITEs. Every atomic add
takes that cache line away from the other cores (and from the thread that
reads it for the heartbeats), so the workers queue for it. The series gave
each GPU its own counters and state, and went from 39% to 48% of 3200 Gbps.
Here each worker writes a counter of its own, padded so that no other
variable shares its cache line; the main thread adds them up.

New since chapter 12: struct counter in chapters/13_shard.c, one per
worker, allocated by the pinned worker; worker() stores into it instead of
an atomic add on a shared total; the progress and stall check sum them.

    python chapters/13_shard.py                                   # server
    python chapters/13_shard.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/13_shard.py --gpus 0,1                        # server, GPUs 0 and 1
"""
# %% [markdown]
# ## Motivation
#     chapter 12: worker g ... atomic total += done      (one cache line, every core)
#     chapter 13: worker g ... counter[g] = counter[g] + done   (its own line)
#                 main thread: sum(counter)              (reads only)

# %%
import os

from common import cli, memory, multinet, topo, workers
import common._native13 as native
from common.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    cores = topo.worker_cores(args.gpus, len(workers.by_group(lanes)))
    errors, control.keep = [], []
    counters, stop = [None] * len(cores), native.ffi.new("int *")

    def work(k, mine):  # chapter 12's, counting on its own
        os.sched_setaffinity(0, {cores[k]})  # 0: the calling thread only, on Linux
        memory.current(mine[0].gpu)
        counters[k] = native.ffi.new("struct counter *")  # its own, allocated after pinning
        workers.call(native, mine, errors, control.keep, counters[k], stop)

    threads = workers.threads_for(lanes, work, errors)
    print(f"{len(threads)} native worker threads, one per GPU, pinned to cores "
          f"{' '.join(map(str, cores))}, a counter each", flush=True)
    done = lambda: sum(c.value for c in counters if c is not None)  # noqa: E731
    return workers.run(threads, lanes, control, beat, page_size, timeout, done,
                       lambda: stop.__setitem__(0, 1), errors)


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "13_shard", warm_up, threaded))

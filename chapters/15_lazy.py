"""Chapter 15 - lazy: submitting only queues a WRITE; the queue is posted after the CQ read.

What you will learn: in chapter 14 a WRITE is posted the moment it is
submitted, and what waits in the pending queue is retried on every visit.
When the provider is full, each of those posts is a call that fails with
-FI_EAGAIN: wasted work, millions of times in a run. The series made posting
lazy (submit only enqueues; the queue is drained when polling completions,
which is when room appears) and reached 97% of 3200 Gbps. The count of
-FI_EAGAIN in the report shows the difference.

New since chapter 14: in chapters/15_lazy.c, submit() only fills the pending
ring, and worker() drains it only after reap() gave completions back (or
when nothing is in flight).

    python chapters/15_lazy.py                                    # server
    python chapters/15_lazy.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/15_lazy.py --gpus 0,1                         # server, GPUs 0 and 1
    python chapters/15_lazy.py --batch 4                          # server, 4 per visit
"""
# %% [markdown]
# ## Motivation
#     chapter 14, per visit: post up to B WRITEs (-FI_EAGAIN when full), read the CQ,
#                            retry the queue
#     chapter 15, per visit: queue up to B WRITEs, read the CQ, post the queue only if
#                            completions made room

# %%
import os

from common import cli, memory, multinet, topo, workers
import common._native15 as native
from common.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    cores = topo.worker_cores(args.gpus, len(workers.by_group(lanes)))
    errors, control.keep = [], []
    counters, stop = [None] * len(cores), native.ffi.new("int *")

    def work(k, mine):  # chapter 14's; its C loop now posts lazily
        os.sched_setaffinity(0, {cores[k]})  # 0: the calling thread only, on Linux
        memory.current(mine[0].gpu)
        counters[k] = native.ffi.new("struct counter *")  # its own, allocated after pinning
        workers.call(native, mine, errors, control.keep, args.batch, counters[k], stop)

    threads = workers.threads_for(lanes, work, errors)
    print(f"{len(threads)} native worker threads, one per GPU, pinned to cores "
          f"{' '.join(map(str, cores))}, a counter each, up to {args.batch} WRITEs per visit,"
          " posted lazily", flush=True)
    done = lambda: sum(c.value for c in counters if c is not None)  # noqa: E731
    return workers.run(threads, lanes, control, beat, page_size, timeout, done,
                       lambda: stop.__setitem__(0, 1), errors)


def add_args(p):
    p.add_argument("--batch", type=cli.count(1, 1024), default=16, metavar="B",
                   help="server: WRITEs posted per visit to a NIC, 1..1024 (default 16)")


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "15_lazy", warm_up, threaded, add_args))

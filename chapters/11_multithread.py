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
The figure: CPU time per WRITE, Python threads against the C loop.

New since chapter 10 (whose warmup it keeps): the engine. One thread per
group (GPU) of lanes; the loop of chapter 09 (and 10) rewritten in C: a visit
to a lane in chapters/11_multithread.c, the moves it makes (submit, pending
ring, reap, immediate on each NIC's last WRITE) in common/engine/lane.h; a shared
atomic counter; --engine python|native. Python's side of the workers
(start, watch, stop) is common/engine/workers.py. Chapters 12-15 share both.

    .venv/bin/python chapters/11_multithread.py                                  # server
    .venv/bin/python chapters/11_multithread.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/11_multithread.py --engine python                  # server, GIL-bound

Transcripts (Python threads, then the loop in C): results/11_multithread/README.md
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
from common.engine.warmup import warmed


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, conn, page_size):
    """One worker per group; the main thread keeps the control endpoint going."""
    errors, conn.keep = [], []
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
            workers.call(native, mine, errors, conn.keep, total, stop)

    threads = workers.threads_for(lanes, work, errors)
    print(f"{len(threads)} {args.engine} worker threads, one per GPU", flush=True)
    return workers.run(threads, lanes, conn, page_size, lambda: total[0], halt, errors)


def add_args(p):
    cli.side("server", p.add_argument("--engine", choices=["native", "python"],
                                      default="native", help="workers in C, GIL released "
                                      "(default), or in Python"))


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "11_multithread", warmed(threaded), add_args, LESSON))

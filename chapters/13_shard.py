"""Chapter 13 - shard: each worker counts on its own cache line; nothing shared is written.

What you will learn: after pinning, the workers of chapter 12 still share one
thing they all write: the atomic count of completed WRITEs. Every atomic add
takes that cache line away from the other cores (and from the thread that
reads it for the heartbeats), so the workers queue for it. The series gave
each GPU its own counters and state, and went from 39% to 48% of 3200 Gbps.
Here each worker writes a counter of its own, padded so that no other
variable shares its cache line; the main thread adds them up.

New since chapter 12: struct counter in chapters/13_shard.c, one per
worker, allocated by the pinned worker; a visit stores into it instead of
an atomic add on a shared total; the progress and stall check sum them.
Starting the workers moves to common/engine/shards.py, which 14 and 15 reuse.

    .venv/bin/python chapters/13_shard.py                                   # server
    .venv/bin/python chapters/13_shard.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/13_shard.py --gpus 0,1                        # server, GPUs 0 and 1

Transcript and figures (a 2-core VM; 2 x H200): results/13_shard/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "CPU per WRITE", "visible": {"than": "12", "by": 1.2},
          "field": "cpu_us_per_write",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000",
          "why_not": {"shm": "Two workers bounce the shared counter's line between two cores "
                             "once per CQ read, too rarely to show; the series had eight "
                             "threads on two sockets.",
                      "tcp": "Two workers bounce the shared counter's line once per CQ read, "
                             "a sliver of the CPU that tcp itself spends per WRITE (several "
                             "times shm's)."}}

# %% [markdown]
# ## Motivation
#     chapter 12: worker g ... atomic total += done      (one cache line, every core)
#     chapter 13: worker g ... counter[g] = counter[g] + done   (its own line)
#                 main thread: sum(counter)              (reads only)

# %%
from common import cli
from common.engine import multinet, shards
import common._native13 as native
from common.engine.warmup import warmed


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, conn, page_size):
    """Chapter 12's pinned workers, each with a counter of its own (common/engine/shards.py)."""
    return shards.run(native, args.gpus, lanes, conn, page_size)


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "13_shard", warmed(threaded), lesson=LESSON))

"""Chapter 10 - warmup: one WRITE per NIC before the clock starts.

What you will learn: the first operation between two endpoints is not like
the others. The provider may set up a connection (tcp; EFA's handshake),
map the peer's memory (shm with CUDA IPC), fill caches and page tables. In
the series (2 AWS p5, efa, libfabric 2.0) the first WRITE on an EFA NIC took
about 20 ms against about 1.2 ms later, across 32 NICs. So before timing,
send one WRITE on every NIC and wait for it; then the clock measures the
steady state only. A second lone WRITE per NIC, also waited for, is what
first contact is compared with: a latency with a latency, printed after the
run.

New since chapter 09: warm_up() (common/engine/warmup.py, shown by scripts/diff.sh 10),
called by chapter 09's loop before its clock starts; the comparison is printed after the
run. The chapters after this one wrap their own loops in the same warmup (warmed()).

    .venv/bin/python chapters/10_warmup.py                                  # server
    .venv/bin/python chapters/10_warmup.py ADDRESS --nics-per-gpu 4         # client

Transcript (tcp on loopback, where the first WRITE opens a connection):
results/10_warmup/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "first WRITE", "visible": {"at_least": 2}, "field": "first_vs_warm",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000"}

# %% [markdown]
# ## Motivation
#     server, for each NIC:  post WRITE(first page) -> wait for its completion
#                            (first contact: connection, mapping, caches)
#     then, clock on:        the run of chapter 09
#     print: first WRITE per NIC vs a WRITE in steady state

# %%
import time

from common import bench, bounds, cli
from common.engine import multinet
from common.engine.warmup import warm_up
from common.fabric import memory


# %% [markdown]
# ## The loop of chapter 09, warmed up
# Before the clock: one WRITE on every lane, waited for, then a second one to compare it
# with. Then the same visits as in chapter 09.

# %%
def write_all(args, lanes, conn, page_size):
    """Chapter 09's loop, after a warmup WRITE on every lane."""
    compare = warm_up(lanes, conn)  # first contact, paid before the clock starts
    timeout, total = conn.timeout, sum(lane.iters for lane in lanes)
    progress = bench.Progress("WRITEs completed", total, page_size)
    start = multinet.clock()
    busy = [lane for lane in lanes if lane.iters]
    stalled = bounds.Deadline(timeout, lambda: f"no WRITE completed for {timeout:g} s "
                              f"({sum(lane.queue.completed for lane in lanes)} of {total} "
                              "done): is the client still there?")
    with stalled:  # also when the provider call itself never returns
        while busy:
            for lane in busy:
                memory.current(lane.gpu)
                lane.post_some()
                if lane.queue.progress():
                    stalled.at = time.monotonic() + timeout
            busy = [lane for lane in busy if lane.queue.completed < lane.iters]
            conn.queue.progress()
            done = sum(lane.queue.completed for lane in lanes)
            if time.monotonic() > stalled.at:
                raise TimeoutError(stalled.what())
            if conn.beat(done):
                progress.update(done)
    progress.close()
    return multinet.Started(start, {"workers": 1, **compare.figures}, compare)


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "10_warmup", write_all, lesson=LESSON))

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

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
2 groups x 2 virtual NICs, 4 KiB pages; commit b8a72b4, another test suite running
beside it, load average 3.3): 2.25 us of CPU per WRITE against chapter 12's 2.30 in the
same minute, no difference a busy 2-core machine can tell (nor could scripts/tour.py,
three runs at 51c3160):

    $ .venv/bin/python chapters/13_shard.py -p shm --clients 1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f31393130383a303a3000
    run the client: .venv/bin/python chapters/13_shard.py -p shm 66695f73686d3a2f2f31393130383a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 3.668 ms on average, 4.020 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 0 1, a counter each
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 84865 times
    100000 WRITEs of 4096 bytes in 0.715 s: 4.582 Gbps, 0.140 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 4096)
    CPU time: 2.25 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 3.668 ms vs 11.0 us on average, each a WRITE alone on its NIC (333x); unwarmed, the slowest first contact would have added 1% to this run

    $ .venv/bin/python chapters/13_shard.py -p shm 66695f73686d3a2f2f31393130383a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes

On 2 x H200 at f6fe2b2 (shm with CUDA IPC, libfabric 2.1.0, each GPU writing to the
other's through 2 virtual NICs, 1 MiB pages): 2592 Gbps, 78.7% of cudaMemcpyPeer both
ways, chapter 12 2589 in the same session; the GPUs' copies bind (chapter 12 says more).
Host memory, 4 KiB pages, same box at 1f179a6 (libfabric 2.1.0, medians of 3,
results/progression/h200x2-shm-host.json): 1.076 Mpps against chapter 12's 1.045. With
two workers the shared line had one other core to bounce to, once per CQ read (up to 64
completions), not per WRITE; the series had eight threads on two sockets.
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
from common.engine.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    """Chapter 12's pinned workers, each with a counter of its own (common/engine/shards.py)."""
    return shards.run(native, args.gpus, lanes, control, beat, page_size, timeout)


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "13_shard", warm_up, threaded, lesson=LESSON))

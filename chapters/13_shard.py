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
Starting the workers moves to common/shards.py, which 14 and 15 reuse.

    python chapters/13_shard.py                                   # server
    python chapters/13_shard.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/13_shard.py --gpus 0,1                        # server, GPUs 0 and 1

Transcript (2 x H200 box: 32-core Xeon, one NUMA node, CUDA-enabled libfabric
2.1.0, shm with CUDA IPC; buffers on GPUs 0 and 1 on both sides, each GPU
writing to the other's; 2 virtual NICs per GPU; 1 MiB pages; commit f6fe2b2):

    $ python chapters/13_shard.py -p shm --clients 1 --gpus 0,1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f343231313a303a3000
    run the client: python chapters/13_shard.py -p shm 66695f73686d3a2f2f343231313a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 6.413 ms on average, 7.807 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 8 24, a counter each
    wrote from 2 x GPU 0 memory (cuda) / GPU 1 memory (cuda); WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 12127426 times
    400000 WRITEs of 1048576 bytes in 1.295 s: 2591.988 Gbps, 0.309 Mpps (78.7% of 3295.574 Gbps, cudaMemcpyPeer both ways here (results/baselines/h200x2-shm-cuda.json))
    first contact vs steady state: 7.807 ms vs 12.9 us per WRITE per NIC (603x)

    $ python chapters/13_shard.py -p shm 66695f73686d3a2f2f343231313a303a3000 --gpus 1,0 --nics-per-gpu 2 --page-size 1M --buffer-size 64M --pages 0-63 --iters 400000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 67108864 bytes of GPU 0 memory (cuda) / GPU 1 memory (cuda)
    immediate data from 4 NICs, one each: 100000 100000 100000 100000
    verified 2 x 64 pages (134217728 bytes): 0 wrong bytes

Chapter 12 in the same session: 2589 Gbps; the GPUs' copies bind (chapter 12
says more). Host memory, 4 KiB pages, same box: 1.076 Mpps against chapter
12's 1.045 (medians of 3). With two workers the shared line had one other
core to bounce to, once per CQ read (up to 64 completions), not per WRITE;
the series had eight threads on two sockets.
"""
# %% [markdown]
# ## Motivation
#     chapter 12: worker g ... atomic total += done      (one cache line, every core)
#     chapter 13: worker g ... counter[g] = counter[g] + done   (its own line)
#                 main thread: sum(counter)              (reads only)

# %%
from common import cli, multinet, shards
import common._native13 as native
from common.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    """Chapter 12's pinned workers, each with a counter of its own (common/shards.py)."""
    return shards.run(native, args.gpus, lanes, control, beat, page_size, timeout)


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "13_shard", warm_up, threaded))

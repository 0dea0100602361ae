"""Chapter 14 - batch: each visit to a NIC posts up to 16 WRITEs, not one.

What you will learn: a worker visits a NIC, posts one WRITE, reads the
CQ, moves to the next NIC. Each WRITE pays for a whole visit: the CQ read
(a call into the provider even when nothing completed), the loop, the checks.
The series let a visit post up to 16 WRITEs and went from 48% to 81% of
3200 Gbps: the visit's cost is shared by up to 16 WRITEs, and each NIC gets
its work in bursts. --batch sets how many (1 gives chapter 13 back).

New since chapter 13: worker() takes `batch`, and a visit submits up to
`batch` new WRITEs instead of one (chapters/14_batch.c); --batch.

    python chapters/14_batch.py                                   # server
    python chapters/14_batch.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/14_batch.py --gpus 0,1                        # server, GPUs 0 and 1
    python chapters/14_batch.py --batch 4                         # server, 4 per visit

Transcript (2 x H200 box: 32-core Xeon, one NUMA node, CUDA-enabled libfabric
2.1.0, shm with CUDA IPC; buffers on GPUs 0 and 1 on both sides, each GPU
writing to the other's; 2 virtual NICs per GPU; 1 MiB pages; commit f6fe2b2):

    $ python chapters/14_batch.py -p shm --clients 1 --gpus 0,1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f343330323a303a3000
    run the client: python chapters/14_batch.py -p shm 66695f73686d3a2f2f343330323a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 5.488 ms on average, 7.504 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 8 24, a counter each, up to 16 WRITEs per visit
    wrote from 2 x GPU 0 memory (cuda) / GPU 1 memory (cuda); WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 12661042 times
    400000 WRITEs of 1048576 bytes in 1.293 s: 2595.417 Gbps, 0.309 Mpps (78.8% of 3295.574 Gbps, cudaMemcpyPeer both ways here (results/baselines/h200x2-shm-cuda.json))
    first contact vs steady state: 7.504 ms vs 12.9 us per WRITE per NIC (580x)

    $ python chapters/14_batch.py -p shm 66695f73686d3a2f2f343330323a303a3000 --gpus 1,0 --nics-per-gpu 2 --page-size 1M --buffer-size 64M --pages 0-63 --iters 400000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 67108864 bytes of GPU 0 memory (cuda) / GPU 1 memory (cuda)
    immediate data from 4 NICs, one each: 100000 100000 100000 100000
    verified 2 x 64 pages (134217728 bytes): 0 wrong bytes

Chapter 13 in the same session: 2592 Gbps; the GPUs' copies bind. Host memory,
4 KiB pages: 1.067 Mpps against chapter 13's 1.076, within the spread of
repeats. Look at -FI_EAGAIN instead: 12.7 million refusals for 400,000
WRITEs. The provider is full almost every time a visit comes, so there is
rarely room for more than one WRITE, let alone 16; posting into room that
is not there is what chapter 15 stops.
"""
# %% [markdown]
# ## Motivation
#     chapter 13, per visit: post 1 WRITE, read the CQ
#     chapter 14, per visit: post up to B WRITEs (B = 16), read the CQ

# %%
from common import cli, multinet, shards
import common._native14 as native
from common.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    """Chapter 13's workers (common/shards.py), posting up to args.batch per visit."""
    return shards.run(native, args.gpus, lanes, control, beat, page_size, timeout, args.batch,
                      say=f", up to {args.batch} WRITEs per visit")


def add_args(p):
    p.add_argument("--batch", type=cli.count(1, 1024), default=16, metavar="B",
                   help="server: WRITEs posted per visit to a NIC, 1..1024 (default 16)")


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "14_batch", warm_up, threaded, add_args))

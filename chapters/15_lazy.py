"""Chapter 15 - lazy: submitting only queues a WRITE; the queue is posted after the CQ read.

What you will learn: in chapter 14 a WRITE is posted the moment it is
submitted, and what waits in the pending queue is retried on every visit.
When the provider is full, each of those posts is a call that fails with
-FI_EAGAIN: wasted work, millions of times in a run. The series made posting
lazy (submit only enqueues; the queue is drained when polling completions,
which is when room appears) and reached 97% of 3200 Gbps. The count of
-FI_EAGAIN in the report shows the difference.

New since chapter 14: in chapters/15_lazy.c, a visit calls enqueue(), which
only fills the pending ring, in place of submit(), and drains the ring only
after reap() gave completions back, as many WRITEs as completed (with
nothing in flight: until the provider is full).

    python chapters/15_lazy.py                                    # server
    python chapters/15_lazy.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/15_lazy.py --gpus 0,1                         # server, GPUs 0 and 1
    python chapters/15_lazy.py --batch 4                          # server, 4 per visit

Transcript (2 x H200 box: 32-core Xeon, one NUMA node, CUDA-enabled libfabric
2.1.0, shm with CUDA IPC; buffers on GPUs 0 and 1 on both sides, each GPU
writing to the other's; 2 virtual NICs per GPU; 1 MiB pages; commit f6fe2b2):

    $ python chapters/15_lazy.py -p shm --clients 1 --gpus 0,1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f343338393a303a3000
    run the client: python chapters/15_lazy.py -p shm 66695f73686d3a2f2f343338393a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 5.586 ms on average, 7.603 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 8 24, a counter each, up to 16 WRITEs per visit, posted lazily
    wrote from 2 x GPU 0 memory (cuda) / GPU 1 memory (cuda); WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 0 times
    400000 WRITEs of 1048576 bytes in 1.292 s: 2596.731 Gbps, 0.310 Mpps (78.8% of 3295.574 Gbps, cudaMemcpyPeer both ways here (results/baselines/h200x2-shm-cuda.json))
    first contact vs steady state: 7.603 ms vs 12.9 us per WRITE per NIC (588x)

    $ python chapters/15_lazy.py -p shm 66695f73686d3a2f2f343338393a303a3000 --gpus 1,0 --nics-per-gpu 2 --page-size 1M --buffer-size 64M --pages 0-63 --iters 400000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 67108864 bytes of GPU 0 memory (cuda) / GPU 1 memory (cuda)
    immediate data from 4 NICs, one each: 100000 100000 100000 100000
    verified 2 x 64 pages (134217728 bytes): 0 wrong bytes

The same 2597 Gbps as chapters 12-14 in this session (2589-2595: the GPUs'
copies bind), but with -FI_EAGAIN 0 times, where chapters 12-14 were refused
10.6 to 12.7 million times for the same 400,000 WRITEs. Host memory, 4 KiB
pages, same box: 1.142 Mpps (chapter 14: 1.067, chapter 09: 0.158; medians
of 3). With 4 MiB pages the two GPUs move 4423 Gbps of verified data, 90% of
what cudaMemcpyPeer moves both ways at once (4904 Gbps, the baseline
scripts/progression.py measured on this box):

    $ python chapters/15_lazy.py -p shm --clients 1 --gpus 0,1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f343437363a303a3000
    run the client: python chapters/15_lazy.py -p shm 66695f73686d3a2f2f343437363a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 6.747 ms on average, 8.698 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 8 24, a counter each, up to 16 WRITEs per visit, posted lazily
    wrote from 2 x GPU 0 memory (cuda) / GPU 1 memory (cuda); WRITEs per NIC: 50000 50000 50000 50000, each NIC's last with immediate data; -FI_EAGAIN 0 times
    200000 WRITEs of 4194304 bytes in 1.517 s: 4423.300 Gbps, 0.132 Mpps (90.2% of 4903.968 Gbps, cudaMemcpyPeer both ways here (results/baselines/h200x2-shm-cuda.json))
    first contact vs steady state: 8.698 ms vs 30.3 us per WRITE per NIC (287x)

    $ python chapters/15_lazy.py -p shm 66695f73686d3a2f2f343437363a303a3000 --gpus 1,0 --nics-per-gpu 2 --page-size 4M --buffer-size 256M --pages 0-63 --iters 200000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 268435456 bytes of GPU 0 memory (cuda) / GPU 1 memory (cuda)
    immediate data from 4 NICs, one each: 50000 50000 50000 50000
    verified 2 x 64 pages (536870912 bytes): 0 wrong bytes
"""
# %% [markdown]
# ## Motivation
#     chapter 14, per visit: post up to B WRITEs (-FI_EAGAIN when full), read the CQ,
#                            retry the queue
#     chapter 15, per visit: queue up to B WRITEs, read the CQ, post the queue only if
#                            completions made room

# %%
from common import cli, multinet, shards
import common._native15 as native
from common.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    """Chapter 14's workers, whose C loop now posts lazily."""
    return shards.run(native, args.gpus, lanes, control, beat, page_size, timeout, args.batch,
                      say=f", up to {args.batch} WRITEs per visit, posted lazily")


def add_args(p):
    p.add_argument("--batch", type=cli.count(1, 1024), default=16, metavar="B",
                   help="server: WRITEs posted per visit to a NIC, 1..1024 (default 16)")


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "15_lazy", warm_up, threaded, add_args))

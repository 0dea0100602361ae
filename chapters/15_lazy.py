"""Chapter 15 - lazy: submitting only queues a WRITE; the queue is posted after the CQ read.

What you will learn: in chapter 14 a WRITE is posted the moment it is
submitted, and what waits in the pending queue is retried on every visit.
When the provider is full, each of those posts is a call that fails with
-FI_EAGAIN: wasted work, millions of times in a run. The series made posting
lazy (submit only enqueues; the queue is drained when polling completions,
which is when room appears) and reached 97% of 3200 Gbps. The count of
-FI_EAGAIN in the report shows the difference where a completion means room
(0 against millions: shm with CUDA IPC, libfabric 2.1.0, 2 x H200, below);
LESSON says why shm's 4 KiB WRITEs on a small machine are refused either way.

New since chapter 14: in chapters/15_lazy.c, a visit calls enqueue(), which
only fills the pending ring, in place of submit(), and drains the ring only
after reap() gave completions back, as many WRITEs as completed (with
nothing in flight: until the provider is full).

    .venv/bin/python chapters/15_lazy.py                                    # server
    .venv/bin/python chapters/15_lazy.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/15_lazy.py --gpus 0,1                         # server, GPUs 0 and 1
    .venv/bin/python chapters/15_lazy.py --batch 4                          # server, 4 per visit

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
2 groups x 2 virtual NICs, 4 KiB pages; commit b8a72b4, another test suite running
beside it, load average 3.3). Here lazy posts are refused too, as LESSON says, if less
often than chapter 14's eager ones this time: 149,011 times for 100,000 WRITEs against
chapter 14's 4,892,547 a minute before (two more runs of each at load 2.7 to 3.3: 100,517
and 242,972 against 6,225,273 and 418,109; 0 to 1.2 million against 8,000 to 1.5 million
in scripts/tour.py, three runs at 51c3160):

    $ .venv/bin/python chapters/15_lazy.py -p shm --clients 1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f31393137383a303a3000
    run the client: .venv/bin/python chapters/15_lazy.py -p shm 66695f73686d3a2f2f31393137383a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 0.636 ms on average, 1.037 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 0 1, a counter each, up to 16 WRITEs per visit, posted lazily
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 149011 times
    100000 WRITEs of 4096 bytes in 0.533 s: 6.145 Gbps, 0.188 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 4096)
    CPU time: 2.18 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 0.636 ms vs 9.0 us on average, each a WRITE alone on its NIC (70x); unwarmed, the slowest first contact would have added 0% to this run

    $ .venv/bin/python chapters/15_lazy.py -p shm 66695f73686d3a2f2f31393137383a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes

On 2 x H200 at f6fe2b2 (shm with CUDA IPC, libfabric 2.1.0, each GPU writing to the
other's through 2 virtual NICs, 1 MiB pages): 2597 Gbps, 78.8% of cudaMemcpyPeer both
ways, the same as chapters 12-14 in that session (2589-2595: the GPUs' copies bind), but
with -FI_EAGAIN 0 times, where chapters 12-14 were refused 10.6 to 12.7 million times for
the same 400,000 WRITEs; with 4 MiB pages, 200,000 WRITEs: 4423 Gbps of verified data,
90.2% of what cudaMemcpyPeer moves both ways at once (4904 Gbps,
results/baselines/h200x2-shm-cuda.json), refused 0 times. Host memory, 4 KiB pages, same
box at 1f179a6 (libfabric 2.1.0, medians of 3, results/progression/h200x2-shm-host.json):
1.142 Mpps, chapter 14 1.067, chapter 09 0.158.
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "refused", "visible": {"than": "14", "by": 2}, "field": "refused",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000",
          "why_not": {"shm": "shm completes a WRITE of up to 4 KiB once it is queued, before "
                             "the peer takes it (prov/shm/src/smr_rma.c), so a completion is "
                             "no promise of room and lazy posts are refused too, the more so "
                             "the less often the peer gets a core."}}

# %% [markdown]
# ## Motivation
#     chapter 14, per visit: post up to B WRITEs (-FI_EAGAIN when full), read the CQ,
#                            retry the queue
#     chapter 15, per visit: queue up to B WRITEs, read the CQ, post the queue only if
#                            completions made room

# %%
from common import cli
from common.engine import multinet, shards
import common._native15 as native
from common.engine.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    """Chapter 14's workers, whose C loop now posts lazily."""
    return shards.run(native, args.gpus, lanes, control, beat, page_size, timeout, args.batch,
                      say=f", up to {args.batch} WRITEs per visit, posted lazily")


def add_args(p):
    cli.side("server", p.add_argument("--batch", type=cli.count(1, 1024), default=16,
                                      metavar="B", help="WRITEs posted per visit to a NIC, "
                                      "1..1024 (default 16)"))


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "15_lazy", warm_up, threaded, add_args, LESSON))

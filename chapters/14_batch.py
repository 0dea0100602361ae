"""Chapter 14 - batch: each visit to a NIC posts up to 16 WRITEs, not one.

What you will learn: a worker visits a NIC, posts one WRITE, reads the
CQ, moves to the next NIC. Each WRITE pays for a whole visit: the CQ read
(a call into the provider even when nothing completed), the loop, the checks.
The series let a visit post up to 16 WRITEs and went from 48% to 81% of
3200 Gbps: the visit's cost is shared by up to 16 WRITEs, and each NIC gets
its work in bursts. --batch sets how many (1 gives chapter 13 back).

A batch is also one doorbell: all its WRITEs but the last go with FI_MORE,
the last without, which rings the NIC. One left open (FI_MORE on its last
post) may never be sent; a refused post closes it too (fi_rma(3): the provider
flushes then). The field has paid for both halves: WRITEs with per-write
immediates under FI_MORE on efa-direct left a receiver at "received 5/10"
(NIXL issue 1862); a progress thread that read the CQ before the closing post
deadlocked a sender, and NIXL turned FI_MORE off on EFA (PR 1924, issue 1921),
then flushed each NIC's batch instead (PR 1966); efa-direct itself held more
WRITEs than the device stages until 2.3.1 rang the doorbell at the device's
batch limit (NEWS.md). Here each NIC's batch closes within its visit, before
its CQ is read; FABRIC_RULES (any set) refuses a CQ read with a batch open.

New since chapter 13: worker() takes `batch`, and a visit submits up to
`batch` new WRITEs instead of one, with FI_MORE on all but the last
(chapters/14_batch.c); --batch.

    .venv/bin/python chapters/14_batch.py                                   # server
    .venv/bin/python chapters/14_batch.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/14_batch.py --gpus 0,1                        # server, GPUs 0 and 1
    .venv/bin/python chapters/14_batch.py --batch 4                         # server, 4 per visit

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
2 groups x 2 virtual NICs, 4 KiB pages; commit b8a72b4, another test suite running
beside it, load average 3.3): 3.63 us of CPU per WRITE against chapter 13's 2.25 a minute
before, and two more runs of each, at load 2.7 to 3.3, gave 3.93 and 2.23 against 2.10 and
2.18: on a busy 2-core machine batching wins nothing (scripts/tour.py, three runs at
51c3160, never found it 1.2x lower):

    $ .venv/bin/python chapters/14_batch.py -p shm --clients 1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f31393133303a303a3000
    run the client: .venv/bin/python chapters/14_batch.py -p shm 66695f73686d3a2f2f31393133303a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 28.323 ms on average, 111.495 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 0 1, a counter each, up to 16 WRITEs per visit
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 4892547 times
    100000 WRITEs of 4096 bytes in 0.333 s: 9.832 Gbps, 0.300 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 4096)
    CPU time: 3.63 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 28.323 ms vs 8.5 us on average, each a WRITE alone on its NIC (3341x); unwarmed, the slowest first contact would have added 33% to this run

    $ .venv/bin/python chapters/14_batch.py -p shm 66695f73686d3a2f2f31393133303a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes

On 2 x H200 at f6fe2b2 (shm with CUDA IPC, libfabric 2.1.0, each GPU writing to the
other's through 2 virtual NICs, 1 MiB pages): 2595 Gbps, 78.8% of cudaMemcpyPeer both
ways, chapter 13 2592 in the same session (the GPUs' copies bind). Host memory, 4 KiB
pages, same box at 1f179a6 (libfabric 2.1.0, medians of 3,
results/progression/h200x2-shm-host.json): 1.067 Mpps against chapter 13's 1.076, within
the spread of repeats. Look at -FI_EAGAIN instead: 12.7 million refusals for 400,000
WRITEs in that GPU run (here 4,892,547 for 100,000, 6.2 and 0.4 million in the repeats). The
provider is full almost every time a visit comes, so there is rarely room for more than
one WRITE, let alone 16; posting into room that is not there is what chapter 15 stops.
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "CPU per WRITE", "visible": {"than": "13", "by": 1.2},
          "field": "cpu_us_per_write",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000",
          "why_not": {"shm": "Where the provider is full at almost every visit (shm on two "
                             "cores), a visit rarely has room for a second WRITE, so nothing "
                             "is shared."}}

# %% [markdown]
# ## Motivation
#     chapter 13, per visit: post 1 WRITE, read the CQ
#     chapter 14, per visit: post up to B WRITEs (B = 16), read the CQ
#                            B - 1 with FI_MORE, the last without: one doorbell

# %%
from common import cli
from common.engine import multinet, shards
import common._native14 as native
from common.engine.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    """Chapter 13's workers (common/engine/shards.py), posting up to args.batch per visit."""
    return shards.run(native, args.gpus, lanes, control, beat, page_size, timeout, args.batch,
                      say=f", up to {args.batch} WRITEs per visit")


def add_args(p):
    cli.side("server", p.add_argument("--batch", type=cli.count(1, 1024), default=16,
                                      metavar="B", help="WRITEs posted per visit to a NIC, "
                                      "1..1024 (default 16)"))


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "14_batch", warm_up, threaded, add_args, LESSON))

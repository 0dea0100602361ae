"""Chapter 14 - batch: each visit to a NIC posts up to 16 WRITEs, not one.

What you will learn: a worker visits a NIC, posts one WRITE, reads the
CQ, moves to the next NIC. Each WRITE pays for a whole visit: the CQ read
(a call into the provider even when nothing completed), the loop, the checks.
The series let a visit post up to 16 WRITEs and went from 48% to 81% of
3200 Gbps: the visit's cost is shared by up to 16 WRITEs, and each NIC gets
its work in bursts. --batch sets how many (1 gives chapter 13 back). A batch
is also one doorbell: all its WRITEs but the last go with FI_MORE, the last
without, which rings the NIC; what a batch left open has cost others is in
the cell "FI_MORE" below.

New since chapter 13: worker() takes `batch`, and a visit submits up to
`batch` new WRITEs instead of one, with FI_MORE on all but the last
(chapters/14_batch.c); --batch.

    .venv/bin/python chapters/14_batch.py                                   # server
    .venv/bin/python chapters/14_batch.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/14_batch.py --gpus 0,1                        # server, GPUs 0 and 1
    .venv/bin/python chapters/14_batch.py --batch 4                         # server, 4 per visit

Transcript and figures (a 2-core VM; 2 x H200): results/14_batch/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "CPU per WRITE", "visible": {"than": "13", "by": 1.2},
          "field": "cpu_us_per_write",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000",
          "why_not": {"shm": "Where the provider is full at almost every visit (shm on two "
                             "cores), a visit rarely has room for a second WRITE, so nothing "
                             "is shared.",
                      # 1.x's tcp is tcp;ofi_rxm, where it moves (results/14_batch/README.md)
                      "tcp": {"2": "2.x's own tcp starts sending a WRITE inside the call "
                                   "that posts it while its socket is free "
                                   "(xnet_tx_queue_insert, prov/tcp/src/xnet_progress.c) and "
                                   "reads no FI_MORE: 13 and 14 cost about the same CPU per "
                                   "WRITE (1.08x at 4 KiB, medians of 3, 2.6.0 on 2 cores)."}}}

# %% [markdown]
# ## FI_MORE: a batch is one doorbell
# All of a batch's WRITEs but the last go with FI_MORE, the last without, which
# rings the NIC. One left open (FI_MORE on its last post) may never be sent; a
# refused post closes it too (fi_rma(3): the provider flushes then). The field
# has paid for both halves: WRITEs with per-write immediates under FI_MORE on
# efa-direct left a receiver at "received 5/10" (NIXL issue 1862); a progress
# thread that read the CQ before the closing post deadlocked a sender, and NIXL
# turned FI_MORE off on EFA (PR 1924, issue 1921), then flushed each NIC's batch
# instead (PR 1966); efa-direct itself held more WRITEs than the device stages
# until 2.3.1 rang the doorbell at the device's batch limit (NEWS.md). Here each
# NIC's batch closes within its visit, before its CQ is read; FABRIC_RULES (any
# set) refuses a CQ read with a batch open.

# %% [markdown]
# ## Motivation
#     chapter 13, per visit: post 1 WRITE, read the CQ
#     chapter 14, per visit: post up to B WRITEs (B = 16), read the CQ
#                            B - 1 with FI_MORE, the last without: one doorbell

# %%
from common import cli
from common.engine import multinet, shards
import common._native14 as native
from common.engine.warmup import warmed


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, conn, page_size):
    """Chapter 13's workers (common/engine/shards.py), posting up to args.batch per visit."""
    return shards.run(native, args.gpus, lanes, conn, page_size, args.batch,
                      say=f", up to {args.batch} WRITEs per visit")


def add_args(p):
    cli.side("server", p.add_argument("--batch", type=cli.count(1, 1024), default=16,
                                      metavar="B", help="WRITEs posted per visit to a NIC, "
                                      "1..1024 (default 16)"))


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "14_batch", warmed(threaded), add_args, LESSON))

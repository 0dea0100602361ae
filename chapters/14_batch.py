"""Chapter 14 - batch: each visit to a NIC posts up to 16 WRITEs, not one.

What you will learn: a worker visits a NIC, posts one WRITE, reads the
CQ, moves to the next NIC. Each WRITE pays for a whole visit: the CQ read
(a call into the provider even when nothing completed), the loop, the checks.
The series let a visit post up to 16 WRITEs and went from 48% to 81% of
3200 Gbps: the visit's cost is shared by up to 16 WRITEs, and each NIC gets
its work in bursts. --batch sets how many (1 gives chapter 13 back). A batch
is also one doorbell: all its WRITEs but the last go with FI_MORE, the last
without, which rings the NIC; a batch fits the send queue's room, and where
FI_MORE is off (efa before libfabric 2.7) and why: the cell "FI_MORE" below.

New since chapter 13: worker() takes `batch` and FI_MORE, and a visit submits
up to `batch` new WRITEs instead of one, with FI_MORE on all but the last
(chapters/14_batch.c); --batch.

    .venv/bin/python chapters/14_batch.py                                   # server
    .venv/bin/python chapters/14_batch.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/14_batch.py --gpus 0,1                        # server, GPUs 0 and 1
    .venv/bin/python chapters/14_batch.py --batch 4                         # server, 4 per visit

Transcript and figures (a 2-core VM; 2 x H200): results/14_batch/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
# 64-byte pages: a WRITE's own copy is small, so what a visit costs is most of its CPU.
# A million WRITEs: a second of CPU or more, which a fixed cost of the run cannot blur.
LESSON = {"figure": "CPU per WRITE", "visible": {"than": "13", "by": 1.2},
          "field": "cpu_us_per_write",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 64 --buffer-size 1M --pages 0-63 "
                    "--iters 1000000",
          "why_not": {"shm": "Where the provider is full at almost every visit (shm on two "
                             "cores), a visit rarely has room for a second WRITE, so nothing "
                             "is shared.",
                      # 1.x's tcp is tcp;ofi_rxm, where it moves (results/14_batch/README.md)
                      "tcp": {"2": "2.x's own tcp starts sending a WRITE inside the call "
                                   "that posts it while its socket is free "
                                   "(xnet_tx_queue_insert, prov/tcp/src/xnet_progress.c) and "
                                   "reads no FI_MORE: 13 costs 1.2x to 2.1x 14's CPU per "
                                   "WRITE (medians of 3, three times, 2.6.0 on 2 cores), "
                                   "with repeats of each in the other's range every time."}}}

# %% [markdown]
# ## FI_MORE: a batch is one doorbell
# All of a batch's WRITEs but the last go with FI_MORE, the last without, which
# rings the NIC. Three ways it goes wrong, and what this chapter does about each
# (the providers' sources, by version: results/14_batch/README.md):
# - A batch left open may never be sent. Each batch here closes within its visit,
#   before its CQ is read; FABRIC_RULES (any set) refuses a CQ read with one open.
# - A batch past the send queue's room (tx_attr.size, less the WRITEs in flight)
#   is lost on efa-direct's rdma-core path (libfabric before 2.3, or
#   FI_EFA_USE_DATA_PATH_DIRECT=0, or an rdma-core without the direct path): each
#   WRITE with FI_MORE returns 0 unchecked, and a closing post that finds the
#   queue full rolls the whole batch back. The lane batches only within the room
#   (common/engine/lane.h submit_more), the rest go one doorbell each;
#   FABRIC_RULES=efa-direct refuses a batch past it.
# - efa's own fabric queues a WRITE it cannot send yet (no handshake with the
#   peer yet, RNR) and, before libfabric 2.7, sends it later with the caller's
#   FI_MORE and no doorbell: a hang. more_flag() below leaves FI_MORE off there.
# The field met them: under FI_MORE on efa-direct a NIXL receiver stopped at
# "received 5/10" (issue 1862), a progress thread that read the CQ before the
# closing post deadlocked a sender (issue 1921), and NIXL turned FI_MORE off on
# EFA (PRs 1924, 2034), then flushed each NIC's batch (PR 1966). shm, tcp and
# verbs pass FI_MORE over; efa-direct rings at the device's batch limit from
# 2.3.1 (NEWS.md).

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
import common.fabric as fi


# %% [markdown]
# ## Code

# %%
def more_flag(info):
    """(FI_MORE or 0, why) for the fabric of `info` on this libfabric (the cell "FI_MORE")."""
    if fi.name_of(info) == "efa" and fi.version() < fi.EFA_RINGS_QUEUED:
        return 0, (f"FI_MORE off: efa's fabric before libfabric "
                   f"{'.'.join(map(str, fi.EFA_RINGS_QUEUED))} may send a WRITE it had to "
                   f"queue with it, and ring no doorbell")
    return fi.lib.FI_MORE, "FI_MORE on all but each batch's last"


def threaded(args, lanes, conn, page_size):
    """Chapter 13's workers (common/engine/shards.py), posting up to args.batch per visit."""
    more, why = more_flag(lanes[0].info)
    return shards.run(native, args.gpus, lanes, conn, page_size, args.batch, more,
                      say=f", up to {args.batch} WRITEs per visit" + ("" if more else
                                                                    f"; {why}"))


def add_args(p):
    cli.side("server", p.add_argument("--batch", type=cli.count(1, 1024), default=16,
                                      metavar="B", help="WRITEs posted per visit to a NIC, "
                                      "1..1024 (default 16)"))


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "14_batch", warmed(threaded), add_args, LESSON))

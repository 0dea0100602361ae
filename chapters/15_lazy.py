"""Chapter 15 - lazy: submitting only queues a WRITE; the queue is posted after the CQ read.

What you will learn: in chapter 14 a WRITE is posted the moment it is
submitted, and what waits in the pending queue is retried on every visit.
When the provider is full, each of those posts is a call that fails with
-FI_EAGAIN: wasted work, millions of times in a run. The series made posting
lazy (submit only enqueues; the queue is drained when polling completions,
which is when room appears) and reached 97% of 3200 Gbps. The count of
-FI_EAGAIN in the report shows the difference where a completion means room
(0 against millions: shm with CUDA IPC, libfabric 2.1.0, 2 x H200);
LESSON says why shm's WRITEs on a small machine are refused either way, and
why libfabric 2.x's own tcp refuses none either way (1.x's tcp, rxm, does:
0 lazy against millions eager, 64 KiB pages on 2 cores).

New since chapter 14: in chapters/15_lazy.c, a visit calls enqueue(), which
only fills the pending ring, in place of submit(), and drains the ring only
after reap() gave completions back, as many WRITEs as completed (with
nothing in flight: until the provider is full).

    .venv/bin/python chapters/15_lazy.py                                    # server
    .venv/bin/python chapters/15_lazy.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/15_lazy.py --gpus 0,1                         # server, GPUs 0 and 1
    .venv/bin/python chapters/15_lazy.py --batch 4                          # server, 4 per visit

Transcript and figures (a 2-core VM; 2 x H200): results/15_lazy/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
# 64 KiB, not the 4 KiB of 10-14: 1.x's tcp (rxm) refuses once 2048 WRITEs of an endpoint
# wait (tx_attr.size: its tx credits, rxm_get_tx_buf in prov/rxm/src/rxm_ep.c), and a
# connection's sockets hold thousands of 4 KiB WRITEs beyond those (tcp_wmem, tcp_rmem),
# so 14 was refused only where its reader fell far behind (0 times in some runs); a few
# hundred of 64 KiB (results/15_lazy/README.md)
LESSON = {"figure": "refused", "visible": {"than": "14", "by": 2}, "field": "refused",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 64K --buffer-size 4M --pages 0-63 "
                    "--iters 20000",
          "why_not": {"shm": "shm completes a WRITE once it is queued for the peer, before "
                             "the peer takes it: up to 4 KiB its data goes in the peer's "
                             "queue, a larger one (copied at once by CMA) leaves a notice "
                             "there (smr_rma_fast, prov/shm/src/smr_rma.c). A completion is "
                             "no promise of room, and lazy posts are refused too, the more so "
                             "the less often the peer gets a core.",
                      # 1.x's tcp is tcp;ofi_rxm: rxm refuses once its tx credits are lent
                      # out (rxm_ep.c), and lazy posts are refused less there
                      "tcp": {"2": "2.x's own tcp takes every WRITE it is given, with no "
                                   "bound on its transfers (xnet_alloc_tx), and refuses "
                                   "none, eager or lazy: chapter 14 is refused 0 times too, "
                                   "so there is nothing for lazy posts to save. 1.x's tcp is "
                                   "rxm's, which refuses once its credits are lent out; "
                                   "-p 'tcp;ofi_rxm' picks that one on 2.x."}}}

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
from common.engine.warmup import warmed


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, conn, page_size):
    """Chapter 14's workers, whose C loop now posts lazily."""
    return shards.run(native, args.gpus, lanes, conn, page_size, args.batch,
                      say=f", up to {args.batch} WRITEs per visit, posted lazily")


def add_args(p):
    cli.side("server", p.add_argument("--batch", type=cli.count(1, 1024), default=16,
                                      metavar="B", help="WRITEs posted per visit to a NIC, "
                                      "1..1024 (default 16)"))


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "15_lazy", warmed(threaded), add_args, LESSON))

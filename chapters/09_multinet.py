"""Chapter 09 - multinet: every NIC of every GPU, WRITEs round robin, one thread polling all.

What you will learn: a NIC is a libfabric domain, with its own endpoint, CQ
and AV, and memory is registered per domain: a key is good on one NIC only.
To use the 32 NICs of a p5, each GPU's buffers are registered on each of its
4 NICs, CONNECT carries every endpoint's address and every (buffer, NIC)
key, the server spreads a GPU's WRITEs round robin over that GPU's NICs
(chapter 08's topology says which), and one thread reads all the CQs. Each
NIC's last WRITE carries immediate data, so the client waits for one
immediate per NIC; before the first WRITE, it puts each of the server's
lanes in its AVs (efa-direct takes a WRITE only from an initiator it knows).
On shm or tcp, --nics-per-gpu N opens N domains as "virtual NICs" and
--groups G stands in for G GPUs with host memory: the shape of a p5.

New since chapter 07: the NICs (common/engine/nics.py, by chapter 08's
topology); a control endpoint (CONNECT, heartbeats, LANDED) beside G x N data
endpoints ("lanes") on each side; one OpQueue per lane (chapter 07's, now
common/engine/opqueue.py); keys per (buffer, NIC); WRITEs round robin; an
immediate per NIC. This page holds the loop that drives them all; the lanes, CONNECT and
the checks are common/engine/multinet.py, which the chapters after this one build on:
read it beside this page (scripts/diff.sh 09 shows both).

    .venv/bin/python chapters/09_multinet.py                                    # server
    .venv/bin/python chapters/09_multinet.py ADDRESS --nics-per-gpu 4           # 1 group x 4 NICs
    .venv/bin/python chapters/09_multinet.py ADDRESS --groups 2 --nics-per-gpu 2 --iters 100000
    .venv/bin/python chapters/09_multinet.py --gpus 0,1                         # server, GPUs 0 and 1

Transcript: results/09_multinet/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check", "field": "writes_per_nic",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000"}

# %% [markdown]
# ## Motivation
#     client                                            server
#     G x N lanes: domain + endpoint + CQ + AV each
#     each group's buffers registered on its N lanes
#     CONNECT(control address, G x N lane addresses,
#             G x N x B (addr, size, key), pages) ---->  G x N lanes of its own
#     each lane's AV: the server's lane   <---- G x N lane addresses
#     "lanes in AVs" --------------------------------->
#                                         <---- lane n of group g: WRITE its pages,
#                                               round robin; last one + immediate
#     one immediate per lane; LANDED ----------------->  stop the clock
#     check every page of every group

# %%
import time

from common import bench, bounds, cli
from common.engine import multinet
from common.fabric import memory


# %% [markdown]
# ## The loop: one thread visits every lane
# Each visit posts what the lane's queue takes and reads its CQ; the control endpoint is
# read between rounds (heartbeats, the client gone). A lane whose WRITEs are all done drops
# out; the run ends when the last one does.

# %%
def write_all(args, lanes, conn, page_size):
    """Every lane's WRITEs, one thread visiting each lane in turn."""
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
    return multinet.Started(start, {"workers": 1})


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "09_multinet", write_all, lesson=LESSON))

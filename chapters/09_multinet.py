"""Chapter 09 - multinet: every NIC of every GPU, WRITEs round robin, one thread polling all.

What you will learn: a NIC is a libfabric domain, with its own endpoint, CQ
and AV, and memory is registered per domain: a key is good on one NIC only.
To use the 32 NICs of a p5, each GPU's buffers are registered on each of its
4 NICs, CONNECT carries every endpoint's address and every (buffer, NIC)
key, the server spreads a GPU's WRITEs round robin over that GPU's NICs, and
one thread reads all the CQs. Each NIC's last WRITE carries immediate data,
once that NIC's other WRITEs have completed, so the client waits for one
immediate per NIC. Before the first WRITE, the client puts each of the
server's lanes in the AV of the lane it writes to (efa-direct's device takes
a WRITE only from an initiator its target knows). Chapter 08's topology says
which NICs are a GPU's.

On a host without NICs (shm, tcp), --nics-per-gpu N opens N domains of the
local provider as "virtual NICs", so the program has the shape it has on a
p5, and it says so. Without --gpus, --groups G stands in for G GPUs with
host memory.

New since chapter 07: the NICs from common/engine/topo.py; a control endpoint
(CONNECT, heartbeats, LANDED) beside G x N data endpoints ("lanes") on each
side; one OpQueue per lane (the queue of chapter 07, now common/engine/opqueue.py);
keys per (buffer, NIC); WRITEs round robin; an immediate per NIC. The code
is common/engine/multinet.py, which the chapters after this one build on: read it
beside this page (scripts/diff.sh 09 shows it too).

    .venv/bin/python chapters/09_multinet.py                                    # server
    .venv/bin/python chapters/09_multinet.py ADDRESS --nics-per-gpu 4           # 1 group x 4 NICs
    .venv/bin/python chapters/09_multinet.py ADDRESS --groups 2 --nics-per-gpu 2 --iters 100000
    .venv/bin/python chapters/09_multinet.py --gpus 0,1                         # server, GPUs 0 and 1

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
commit b8a72b4, load average 2.4 with another test suite running beside it; first the
client the server printed, pasted (2 groups x 2 virtual NICs, 4 KiB), then 1 x 4 virtual
NICs, 64 KiB):

    $ .venv/bin/python chapters/09_multinet.py -p shm --clients 2
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f31373934313a303a3000
    run the client: .venv/bin/python chapters/09_multinet.py -p shm 66695f73686d3a2f2f31373934313a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 110 times
    100000 WRITEs of 4096 bytes in 0.761 s: 4.303 Gbps, 0.131 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 4096)
    CPU time: 5.33 us per WRITE (this process, all threads)
    1 x 4 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    wrote from 1 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 8 times
    100000 WRITEs of 65536 bytes in 1.055 s: 49.683 Gbps, 0.095 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 65536)
    CPU time: 8.26 us per WRITE (this process, all threads)

    $ .venv/bin/python chapters/09_multinet.py -p shm 66695f73686d3a2f2f31373934313a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes
    $ .venv/bin/python chapters/09_multinet.py -p shm 66695f73686d3a2f2f31373934313a303a3000 --nics-per-gpu 4 --iters 100000 --buffer-size 64M --pages 0-63
    provider: shm (asked for), fabric shm, domain shm
    1 x 4 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 1 x 2 x 67108864 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 1 x 64 pages (4194304 bytes): 0 wrong bytes
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
from common import cli
from common.engine import multinet

if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "09_multinet", lesson=LESSON))

"""Chapter 10 - warmup: one WRITE per NIC before the clock starts.

What you will learn: the first operation between two endpoints is not like
the others. The provider may set up a connection (tcp; EFA's handshake),
map the peer's memory (shm with CUDA IPC), fill caches and page tables. In
the series (2 AWS p5, efa, libfabric 2.0) the first WRITE on an EFA NIC took
about 20 ms against about 1.2 ms later, across 32 NICs. So before timing, send one WRITE on every NIC
and wait for it; then the clock measures the steady state only. A second lone
WRITE per NIC, also waited for, is what first contact is compared with: a
latency with a latency, printed after the run.

New since chapter 09: warm_up() (common/engine/warmup.py, shown by scripts/diff.sh 10),
run by the engine of chapter 09 (common/engine/multinet.py) between building the WRITE
messages and starting the clock; the comparison printed after the run.

    .venv/bin/python chapters/10_warmup.py                                  # server
    .venv/bin/python chapters/10_warmup.py ADDRESS --nics-per-gpu 4         # client

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, tcp on loopback,
host memory, commit b8a72b4, load average 3.5 with another test suite running beside
it; the first WRITE on each NIC opens a TCP connection; first the client the server
printed, pasted (2 groups x 2 virtual NICs, 4 KiB), then 1 x 4 virtual NICs, 64 KiB):

    $ FI_TCP_IFACE=lo .venv/bin/python chapters/10_warmup.py -p tcp --clients 2
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    server address: 0200a1717f0000010000000000000000
    run the client: .venv/bin/python chapters/10_warmup.py -p tcp 0200a1717f0000010000000000000000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of tcp (no NIC with a PCI address here)
    warmup: first WRITE per NIC 50.058 ms on average, 107.915 ms at most (4 NICs)
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 31544 times
    100000 WRITEs of 4096 bytes in 2.395 s: 1.368 Gbps, 0.042 Mpps (no link speed, and no fi_rma_bw baseline of this machine, tcp and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p tcp --sizes 4096)
    CPU time: 13.00 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 50.058 ms vs 30.7 us on average, each a WRITE alone on its NIC (1630x); unwarmed, the slowest first contact would have added 5% to this run
    1 x 4 virtual NICs: independent domains of tcp (no NIC with a PCI address here)
    warmup: first WRITE per NIC 25.049 ms on average, 33.155 ms at most (4 NICs)
    wrote from 1 x host memory; WRITEs per NIC: 2500 2500 2500 2500, each NIC's last with immediate data; -FI_EAGAIN 167660 times
    10000 WRITEs of 65536 bytes in 4.652 s: 1.127 Gbps, 0.002 Mpps (no link speed, and no fi_rma_bw baseline of this machine, tcp and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p tcp --sizes 65536)
    CPU time: 426.13 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 25.049 ms vs 36.9 us on average, each a WRITE alone on its NIC (679x); unwarmed, the slowest first contact would have added 1% to this run

    $ FI_TCP_IFACE=lo .venv/bin/python chapters/10_warmup.py -p tcp 0200a1717f0000010000000000000000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    2 x 2 virtual NICs: independent domains of tcp (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes
    $ FI_TCP_IFACE=lo .venv/bin/python chapters/10_warmup.py 0200a1717f0000010000000000000000 -p tcp --nics-per-gpu 4 --iters 10000 --buffer-size 64M --pages 0-63
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    1 x 4 virtual NICs: independent domains of tcp (no NIC with a PCI address here)
    memory: 1 x 2 x 67108864 bytes of host memory
    immediate data from 4 NICs, one each: 2500 2500 2500 2500
    verified 1 x 64 pages (4194304 bytes): 0 wrong bytes
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "first WRITE", "visible": {"at_least": 2}, "field": "first_vs_warm",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000"}

# %% [markdown]
# ## Motivation
#     server, for each NIC:  post WRITE(first page) -> wait for its completion
#                            (first contact: connection, mapping, caches)
#     then, clock on:        the run of chapter 09
#     print: first WRITE per NIC vs a WRITE in steady state

# %%
from common import cli
from common.engine import multinet
from common.engine.warmup import warm_up

if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "10_warmup", warm_up, lesson=LESSON))

"""Chapter 10 - warmup: one WRITE per NIC before the clock starts.

What you will learn: the first operation between two endpoints is not like
the others. The provider may set up a connection (tcp; EFA's handshake),
map the peer's memory (shm with CUDA IPC), fill caches and page tables. In
the series the first WRITE on an EFA NIC took about 20 ms against about
1.2 ms later, across 32 NICs. So before timing, send one WRITE on every NIC
and wait for it; then the clock measures the steady state only, and we print
what first contact cost next to it.

New since chapter 09: warm_up() (common/warmup.py, shown by scripts/diff.sh 10),
run by the engine of chapter 09 (common/multinet.py) between building the WRITE
messages and starting the clock; the comparison printed after the run.

    python chapters/10_warmup.py                                  # server
    python chapters/10_warmup.py ADDRESS --nics-per-gpu 4         # client

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, tcp on loopback,
host memory, 4 virtual NICs; the first WRITE on each opens a TCP connection):

    $ python chapters/10_warmup.py -p tcp --clients 1
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    server address: 02008f1d7f0000010000000000000000
    run the client: python chapters/10_warmup.py -p tcp 02008f1d7f0000010000000000000000
    1 x 4 virtual NICs: independent domains of tcp (no NIC with a PCI address here)
    warmup: first WRITE per NIC 34.352 ms on average, 60.487 ms at most (4 NICs)
    wrote from 1 x host memory; WRITEs per NIC: 2500 2500 2500 2500, each NIC's last with immediate data; -FI_EAGAIN 11785 times
    10000 WRITEs of 65536 bytes in 0.272 s: 19.244 Gbps, 0.037 Mpps (179.7% of 10.708 Gbps, fi_rma_bw here (results/baselines/vm-2core-tcp-host.json))
    first contact vs steady state: 60.487 ms vs 109.0 us per WRITE per NIC (555x)

    $ python chapters/10_warmup.py 02008f1d7f0000010000000000000000 -p tcp --nics-per-gpu 4 --iters 10000 --buffer-size 64M --pages 0-63
    provider: tcp;ofi_rxm (asked for), fabric 127.0.0.1/32, domain lo
    1 x 4 virtual NICs: independent domains of tcp (no NIC with a PCI address here)
    memory: 1 x 2 x 67108864 bytes of host memory
    immediate data from 4 NICs, one each: 2500 2500 2500 2500
    verified 1 x 64 pages (4194304 bytes): 0 wrong bytes
"""
# %% [markdown]
# ## Motivation
#     server, for each NIC:  post WRITE(first page) -> wait for its completion
#                            (first contact: connection, mapping, caches)
#     then, clock on:        the run of chapter 09
#     print: first WRITE per NIC vs a WRITE in steady state

# %%
from common import cli, multinet
from common.warmup import warm_up

if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "10_warmup", warm_up))

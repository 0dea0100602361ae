"""Chapter 12 - pin: each GPU's worker thread on a core of its own, next to its GPU.

What you will learn: a thread the scheduler is free to move pays for it on
every move (cold caches; on a two-socket machine, memory and NICs on the
other NUMA node). The series pinned each GPU's thread to the core chapter 08
picked for that GPU, and went from 11% to 39% of 3200 Gbps: the biggest
single step of the series. Two details matter: pin the thread itself, not
the process (os.sched_setaffinity(0, ...) from inside the thread), and
allocate what the thread uses after pinning, because Linux places a page on
the NUMA node of the core that first touches it.

New since chapter 11: each worker pins itself (topo.worker_cores: chapter
08's core per GPU; with host memory, an even share of the physical cores),
then allocates its lanes' bookkeeping, then runs the same C loop
(chapters/12_pin.c differs from 11's only in its comment). The Python engine
of chapter 11 made its point and is gone.

    .venv/bin/python chapters/12_pin.py                                     # server
    .venv/bin/python chapters/12_pin.py ADDRESS --groups 2 --nics-per-gpu 2
    .venv/bin/python chapters/12_pin.py --gpus 0,1                          # server, GPUs 0 and 1

Transcript (2-core x86_64 VM without a NIC, Debian's libfabric 1.17, shm, host memory,
2 groups x 2 virtual NICs, 4 KiB pages; commit b8a72b4, another test suite running
beside it, load average 3.3). Here pinning wins nothing: 2.30 us of CPU per WRITE against
chapter 11's 2.09 in the same minute, and scripts/tour.py, run three times at 51c3160,
never found it 1.2x lower (LESSON says why a machine this small has nothing to give):

    $ .venv/bin/python chapters/12_pin.py -p shm --clients 1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f31393038363a303a3000
    run the client: .venv/bin/python chapters/12_pin.py -p shm 66695f73686d3a2f2f31393038363a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 1.660 ms on average, 2.413 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 0 1
    wrote from 2 x host memory; WRITEs per NIC: 25000 25000 25000 25000, each NIC's last with immediate data; -FI_EAGAIN 34387 times
    100000 WRITEs of 4096 bytes in 0.702 s: 4.670 Gbps, 0.143 Mpps (no link speed, and no fi_rma_bw baseline of this machine, shm and libfabric 1.17; measure one: bash scripts/build_libfabric.sh && LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh && .venv/bin/python scripts/baseline.py -p shm --sizes 4096)
    CPU time: 2.30 us per WRITE (this process, all threads)
    first contact vs a warm WRITE: 1.660 ms vs 9.5 us on average, each a WRITE alone on its NIC (174x); unwarmed, the slowest first contact would have added 0% to this run

    $ .venv/bin/python chapters/12_pin.py -p shm 66695f73686d3a2f2f31393038363a303a3000 --groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 --iters 100000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 1048576 bytes of host memory
    immediate data from 4 NICs, one each: 25000 25000 25000 25000
    verified 2 x 64 pages (524288 bytes): 0 wrong bytes

On 2 x H200 at f6fe2b2 (shm with CUDA IPC, libfabric 2.1.0, each GPU writing to the
other's through 2 virtual NICs, 1 MiB pages): 2589 Gbps, 78.6% of cudaMemcpyPeer both
ways. There a WRITE of GPU memory is a copy made by the GPUs, and the copies bind whatever
the CPU does: chapters 11-15 all made 2581-2592 Gbps at 1 MiB, 90% of cudaMemcpyPeer at
4 MiB (same box at 3d90e20, scripts/progression.py, results/progression/h200x2-shm-cuda.json).
Where the CPU moves the data, pinning shows, a little: same box at 1f179a6 (shm, host
memory, libfabric 2.1.0, 4 KiB pages, 2 x 2 virtual NICs, medians of 3,
results/progression/h200x2-shm-host.json), chapter 11 1.011 Mpps, chapter 12 1.045. One
socket and an idle scheduler leave little to win; the p5's 3.5x came from two sockets and
eight busy threads.
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "CPU per WRITE", "visible": {"than": "11", "by": 1.2},
          "field": "cpu_us_per_write",
          "client": "--groups 2 --nics-per-gpu 2 --page-size 4K --buffer-size 1M --pages 0-63 "
                    "--iters 100000",
          "why_not": {"shm": "With one NUMA node and two cores that the client shares, a "
                             "pinned worker has nowhere better to be: the series' step needs "
                             "a socket's worth of cores per GPU and two sockets.",
                      "tcp": "One NUMA node and two cores, shared with the client and with "
                             "the kernel's TCP work: a pinned worker has nowhere better to "
                             "be (within 10% of chapter 11's CPU per WRITE, 13 repeats on "
                             "a 2-core VM)."}}

# %% [markdown]
# ## Motivation
#     worker g: sched_setaffinity(this thread, core of GPU g)   <- new
#               allocate its lanes' contexts and rings            <- now after pinning
#               run the C loop of chapter 11 (GIL released)

# %%
import os

from common import cli
from common.engine import multinet, topo, workers
from common.fabric import memory
import common._native12 as native
from common.engine.warmup import warm_up


# %% [markdown]
# ## Code

# %%
def threaded(args, lanes, control, beat, page_size, timeout):
    cores = topo.worker_cores(args.gpus, len(workers.by_group(lanes)))
    errors, control.keep = [], []
    total, stop = native.ffi.new("uint64_t *"), native.ffi.new("int *")

    def work(k, mine):  # chapter 11's native worker, pinned: move, then allocate, then run
        os.sched_setaffinity(0, {cores[k]})  # 0: the calling thread only, on Linux
        memory.current(mine[0].gpu)
        workers.call(native, mine, errors, control.keep, total, stop)  # allocates, runs

    threads = workers.threads_for(lanes, work, errors)
    print(f"{len(threads)} native worker threads, one per GPU, pinned to cores "
          f"{' '.join(map(str, cores))}", flush=True)
    return workers.run(threads, lanes, control, beat, page_size, timeout, lambda: total[0],
                       lambda: stop.__setitem__(0, 1), errors)


if __name__ == "__main__":
    cli.run(lambda: multinet.run(__doc__, "12_pin", warm_up, threaded, lesson=LESSON))

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

    python chapters/12_pin.py                                     # server
    python chapters/12_pin.py ADDRESS --groups 2 --nics-per-gpu 2
    python chapters/12_pin.py --gpus 0,1                          # server, GPUs 0 and 1

Transcript (2 x H200 box: 32-core Xeon, one NUMA node, CUDA-enabled libfabric
2.1.0, shm with CUDA IPC; buffers on GPUs 0 and 1 on both sides, each GPU
writing to the other's; 2 virtual NICs per GPU; 1 MiB pages; commit f6fe2b2):

    $ python chapters/12_pin.py -p shm --clients 1 --gpus 0,1
    provider: shm (asked for), fabric shm, domain shm
    server address: 66695f73686d3a2f2f343132343a303a3000
    run the client: python chapters/12_pin.py -p shm 66695f73686d3a2f2f343132343a303a3000
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    warmup: first WRITE per NIC 5.438 ms on average, 7.986 ms at most (4 NICs)
    2 native worker threads, one per GPU, pinned to cores 8 24
    wrote from 2 x GPU 0 memory (cuda) / GPU 1 memory (cuda); WRITEs per NIC: 100000 100000 100000 100000, each NIC's last with immediate data; -FI_EAGAIN 10596922 times
    400000 WRITEs of 1048576 bytes in 1.296 s: 2589.367 Gbps, 0.309 Mpps (78.6% of 3295.574 Gbps, cudaMemcpyPeer both ways here (results/baselines/h200x2-shm-cuda.json))
    first contact vs steady state: 7.986 ms vs 13.0 us per WRITE per NIC (616x)

    $ python chapters/12_pin.py -p shm 66695f73686d3a2f2f343132343a303a3000 --gpus 1,0 --nics-per-gpu 2 --page-size 1M --buffer-size 64M --pages 0-63 --iters 400000
    provider: shm (asked for), fabric shm, domain shm
    2 x 2 virtual NICs: independent domains of shm (no NIC with a PCI address here)
    memory: 2 x 2 x 67108864 bytes of GPU 0 memory (cuda) / GPU 1 memory (cuda)
    immediate data from 4 NICs, one each: 100000 100000 100000 100000
    verified 2 x 64 pages (134217728 bytes): 0 wrong bytes

Chapter 11 with the same arguments on the same box: 2601 Gbps (an earlier run;
chapters 12-15 in this session: 2589-2597). Here a WRITE
of GPU memory is a copy made by the GPUs, and the copies bind at 2600 Gbps
whatever the CPU does (78% of cudaMemcpyPeer both ways at 1 MiB, 90% with
4 MiB pages: scripts/progression.py, results/progression/). Where the CPU
moves the data, pinning shows, a little: host memory, 4 KiB pages, 2 x 2
virtual NICs, same box: chapter 11 1.011 Mpps, chapter 12 1.045 Mpps
(medians of 3). One socket and an idle scheduler leave little to win; the
p5's 3.5x came from two sockets and eight busy threads.
"""
# %% [markdown]
# ## Motivation
#     worker g: sched_setaffinity(this thread, core of GPU g)   <- new
#               allocate its lanes' contexts and rings            <- now after pinning
#               run the C loop of chapter 11 (GIL released)

# %%
import os

from common import cli, memory, multinet, topo, workers
import common._native12 as native
from common.warmup import warm_up


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
    cli.run(lambda: multinet.run(__doc__, "12_pin", warm_up, threaded))

"""How long one update of a counter takes when T threads share its cache line (the model's atomic_us).

    .venv/bin/python scripts/atomic_bench.py --label vm-2core          # T = 1 .. every core here
    .venv/bin/python scripts/atomic_bench.py --label my-box --threads 2,4,8 --cpus 0,12,24,36,48,60,72,84

Each of T threads, pinned to a core of its own, adds 1 to a counter with an
atomic fetch-add (`lock xadd` on x86), three ways:
- own: each to a counter of its own, alone on 128 bytes (Intel's prefetcher
  fetches lines in pairs): no line moves, what is left is the locked add;
- shared: all to one counter, as fast as they can: a core that holds the
  line may add several times before another takes it;
- turns: all to one counter, each when the count says it is its turn, so
  that every update takes the line from another core. This is the model's
  chapter 12, where each thread adds once per WRITE, microseconds apart, and
  finds the line wherever the last update left it: its ns per update is what
  common/model/calibration.py takes for atomic_us.
The threads start once all are pinned and stop when the first of them has
done --updates, so that all T run for all of the time measured (from the
first start to the last stop). ns per update: time / all updates for the
shared counter (its line serves one update at a time), time x T / all
updates for own counters (one thread's). The counters must end at the exact
count of updates made. Medians of --repeats runs go to
results/model/atomic-<label>.json with the machine, command, date and commit.

Built with cffi (API mode) into a temporary folder at each run; needs a C
compiler and cffi, no libfabric.
"""
import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from cffi import FFI

from common import records, usage  # no libfabric: the standard library only

ROOT = Path(__file__).resolve().parents[1]

CDEF = "double hammer(int threads, const int *cpus, int mode, uint64_t updates);"
MODES = {"own": 0, "shared": 1, "turns": 2}  # as in the C below
SOURCE = r"""
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* pthread_setaffinity_np, CPU_SET (Python.h defines it already) */
#endif
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

struct counter { _Alignas(128) uint64_t value; };  /* alone on two cache lines */

enum { OWN, SHARED, TURNS };

struct job {
    struct counter *counter;
    int me, mode, cpu, pinned, threads;
    uint64_t updates, done;
    int *ready, *stop;
    double start, end;
};

static double now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

/* Pinned, wait for the others (the main thread sleeps in pthread_join, so every thread has
   its core), add until `updates` or until another thread got there: all of them run for all
   of the time measured. */
static void *add(void *arg)
{
    struct job *j = arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(j->cpu, &set);
    j->pinned = pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
    __atomic_fetch_add(j->ready, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(j->ready, __ATOMIC_ACQUIRE) < j->threads)
        ;
    j->start = now_ns();
    uint64_t i = 0;
    for (; i < j->updates && !__atomic_load_n(j->stop, __ATOMIC_RELAXED); i++) {
        if (j->mode == TURNS)  /* wait until the count says it is this thread's turn */
            while (__atomic_load_n(&j->counter->value, __ATOMIC_ACQUIRE) % j->threads
                   != (uint64_t)j->me)
                if (__atomic_load_n(j->stop, __ATOMIC_RELAXED))
                    goto done;
        __atomic_fetch_add(&j->counter->value, 1, __ATOMIC_SEQ_CST);
    }
done:
    __atomic_store_n(j->stop, 1, __ATOMIC_RELAXED);
    j->end = now_ns();
    j->done = i;
    return NULL;
}

/* ns per update: of the shared line (time / all updates), or of one thread on its own
   counter (time x threads / all updates). -1: no memory or thread, -2: a thread could not be
   pinned, -3: a counter lost an update. */
double hammer(int threads, const int *cpus, int mode, uint64_t updates)
{
    int shared = mode != OWN;
    struct counter *counters = aligned_alloc(128, threads * sizeof *counters);
    struct job *jobs = calloc(threads, sizeof *jobs);
    pthread_t *ids = calloc(threads, sizeof *ids);
    int ready = 0, stop = 0, started = 0;
    double result = -1;
    if (!counters || !jobs || !ids)
        goto out;
    for (int t = 0; t < threads; t++) {
        counters[t].value = 0;
        jobs[t] = (struct job){.counter = &counters[shared ? 0 : t], .me = t, .mode = mode,
                               .cpu = cpus[t],
                               .threads = threads, .updates = updates, .ready = &ready,
                               .stop = &stop};
    }
    for (; started < threads; started++)
        if (pthread_create(&ids[started], NULL, add, &jobs[started]))
            break;
    if (started < threads)  /* release the ones waiting for the others */
        __atomic_fetch_add(&ready, threads, __ATOMIC_SEQ_CST);
    for (int t = 0; t < started; t++)
        pthread_join(ids[t], NULL);
    if (started < threads)
        goto out;
    double first = jobs[0].start, last = jobs[0].end;
    uint64_t total = 0;
    result = 0;
    for (int t = 0; t < threads; t++) {
        first = jobs[t].start < first ? jobs[t].start : first;
        last = jobs[t].end > last ? jobs[t].end : last;
        total += jobs[t].done;
        if (!jobs[t].pinned)
            result = -2;
        if (!shared && counters[t].value != jobs[t].done)
            result = -3;
    }
    if (shared && counters[0].value != total)
        result = -3;
    if (result == 0)
        result = (last - first) / total * (shared ? 1 : threads);
out:
    free(counters);
    free(jobs);
    free(ids);
    return result;
}
"""
FAILED = {-1: "out of memory or threads", -2: "a thread could not be pinned to its core",
          -3: "a counter lost updates"}


def build(folder):
    """The compiled C above, as a module."""
    ffi = FFI()
    ffi.cdef(CDEF)
    ffi.set_source("_atomic_bench", SOURCE, extra_compile_args=["-O2"], libraries=["pthread"])
    path = ffi.compile(tmpdir=folder)
    spec = importlib.util.spec_from_file_location("_atomic_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine():
    """records.machine(), and the sockets the cores sit on (a line's trip may cross them)."""
    sockets = {line for line in open("/proc/cpuinfo") if line.startswith("physical id")}
    return {**records.machine(), "sockets": len(sockets) or None}


def numbers(text):
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text}")
    if min(values) < 0:
        raise argparse.ArgumentTypeError(f"negative: {text}")
    return values


def main():
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="machine name for the file")
    p.add_argument("--cpus", type=numbers, help="cores to pin to, in order (default: every "
                                                "core this process may use)")
    p.add_argument("--threads", type=numbers, help="thread counts (default: 1 .. len(cpus))")
    p.add_argument("--updates", type=int, default=2_000_000, help="per thread and run")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    cpus = args.cpus or sorted(os.sched_getaffinity(0))
    threads = args.threads or list(range(1, len(cpus) + 1))
    if max(threads) > len(cpus) or min(threads) < 1:
        sys.exit(f"atomic_bench: --threads must be 1 to {len(cpus)} (one core each)")
    try:
        records.parse_label(args.label)
    except argparse.ArgumentTypeError as e:
        sys.exit(f"atomic_bench: --label: {e}")
    if args.updates < 1 or args.repeats < 1:
        sys.exit("atomic_bench: --updates and --repeats must be at least 1")

    with tempfile.TemporaryDirectory() as folder:
        lib = build(folder).lib
        rows = []
        for t in threads:
            row = {"threads": t, "cpus": cpus[:t]}
            for key, mode in MODES.items():
                per = [lib.hammer(t, cpus[:t], mode, args.updates) for _ in range(args.repeats)]
                if min(per) < 0:
                    sys.exit(f"atomic_bench: {FAILED[int(min(per))]}")
                row[f"{key}_ns"] = round(statistics.median(per), 2)
                row[f"{key}_ns_runs"] = [round(v, 2) for v in per]
            rows.append(row)
            print(f"{t:>3} threads on cores {','.join(map(str, cpus[:t]))}: ns per update: "
                  + ", ".join(f"{key} {row[key + '_ns']:.2f}" for key in MODES))
    record = {"kind": "atomic_bench", "machine": machine(),
              "command": "python scripts/atomic_bench.py " + " ".join(sys.argv[1:]),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "git": records.git_sha(), "updates": args.updates, "repeats": args.repeats,
              "own": "ns per update of a thread's own counter: time x threads / all updates",
              "shared": "ns per update of one counter all add to at will: time / all updates",
              "turns": "ns per update of one counter all add to in turn: time / all updates",
              "runs": rows}
    out = records.write_json(ROOT / "results" / "model" / f"atomic-{args.label}.json", record)
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    usage.run(main)

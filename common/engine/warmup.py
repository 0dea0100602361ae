"""Chapter 10's warmup: one WRITE per NIC before the clock starts, and what it cost.

The first operation between two endpoints sets things up (a TCP connection,
EFA's handshake, shm's mapping of the peer); timing it apart from the steady
state says how much a run that skips the warmup pays. Like is compared with
like: the first WRITE's latency with that of a second, lone WRITE on the same
NIC, once the first is done.
"""
import time

from common import bounds
from common.engine.multinet import Started
from common.fabric import memory


def warmed(engine):
    """`engine`, with chapter 10's warmup before its clock starts: the engines of the
    chapters after it."""
    def warm_then_run(args, lanes, conn, page_size):
        compare = warm_up(lanes, conn)
        run = engine(args, lanes, conn, page_size)
        return Started(run.at, {**run.figures, **compare.figures}, compare)
    return warm_then_run


def warm_up(lanes, conn):
    """Two WRITEs per lane, one after the other, each waited for: first contact, then a
    warm one; returns what prints the comparison after the run."""
    first = [one_write(lane, conn, k) for k, lane in enumerate(lanes)]
    warm = [one_write(lane, conn, k) for k, lane in enumerate(lanes)]
    for lane in lanes:
        lane.queue.completed = 0  # the warmup is not part of the run's count
    print(f"warmup: first WRITE per NIC {1e3 * sum(first) / len(first):.3f} ms on average, "
          f"{1e3 * max(first):.3f} ms at most ({len(first)} NICs)", flush=True)

    mean_first, mean_warm = sum(first) / len(first), sum(warm) / len(warm)

    def compare(elapsed):
        print(f"first contact vs a warm WRITE: {1e3 * mean_first:.3f} ms vs "
              f"{1e6 * mean_warm:.1f} us on average, each a WRITE alone on its NIC "
              f"({mean_first / mean_warm:.0f}x); unwarmed, the slowest first contact would "
              f"have added {100 * (max(first) - mean_warm) / elapsed:.0f}% to this run")
    compare.figures = {"first_write_ms": [1e3 * t for t in first],  # per NIC, for --json
                       "warm_write_us": [1e6 * t for t in warm],
                       "first_vs_warm": mean_first / mean_warm}
    return compare


def one_write(lane, conn, k):
    """Post one WRITE on `lane` and wait for its completion; its latency in seconds."""
    start = time.perf_counter()
    memory.current(lane.gpu)
    lane.queue.write(lane.messages[0])
    late = f"warmup WRITE on NIC {k} not completed in {conn.timeout:g} s"
    with bounds.Deadline(conn.timeout, late) as deadline:
        while not lane.queue.progress():
            conn.queue.progress()  # heartbeats keep going meanwhile
            if time.monotonic() > deadline.at:
                raise TimeoutError(late)
    return time.perf_counter() - start

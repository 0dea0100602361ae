"""Chapter 10's warmup: one WRITE per NIC before the clock starts, and what it cost.

The first operation between two endpoints sets things up (a TCP connection,
EFA's handshake, shm's mapping of the peer); timing it apart from the steady
state says how much a run that skips the warmup pays.
"""
import time

from common import memory


def warm_up(lanes, control, timeout):
    """One WRITE per lane, each waited for; returns what prints the comparison later."""
    first = []
    for lane in lanes:
        start = time.perf_counter()
        memory.current(lane.gpu)
        lane.queue.write(lane.messages[0])
        deadline = time.monotonic() + timeout
        while not lane.queue.progress():
            control.queue.progress()  # heartbeats keep going meanwhile
            if time.monotonic() > deadline:
                raise TimeoutError(f"warmup WRITE on NIC {len(first)} not completed in "
                                   f"{timeout:g} s")
        first.append(time.perf_counter() - start)
        lane.queue.completed = 0  # the warmup is not part of the run's count
    print(f"warmup: first WRITE per NIC {1e3 * sum(first) / len(first):.3f} ms on average, "
          f"{1e3 * max(first):.3f} ms at most ({len(first)} NICs)", flush=True)

    def compare(elapsed):
        steady = elapsed * len(lanes) / sum(lane.iters for lane in lanes)
        print(f"first contact vs steady state: {1e3 * max(first):.3f} ms vs "
              f"{1e6 * steady:.1f} us per WRITE per NIC ({max(first) / steady:.0f}x)")
    return compare


"""A model of one writer driving G GPUs x N NICs, the engine of chapters 07-15.

No GPU or NIC needed: given the hardware (`Machine`), what the CPU spends per
call (`Costs`) and how a chapter drives them (`Layout`), `throughput` finds
the highest steady rate of WRITEs that every resource can sustain:

- the link: a NIC moves at most `efficiency x link_gbps`;
- the CPU: a thread goes round its NICs; each visit reads the NIC's CQ and
  posts at most `batch` WRITEs, so a visit to each NIC costs
  `visit_us + k x post_us` for the k WRITEs it posts (times the penalties below);
- the queue (Little's law): a NIC holds at most `inflight` WRITEs, and a
  WRITE holds its place from the post until a later visit reaps its completion
  (wire time + latency + half a round of the thread on average) and, when
  posting is eager, one more round, since the place it frees is only filled
  at the next visit;
- a counter shared by every thread: its cache line serves one update at a time.

Threads slow each other on a NUMA node (`crowd`) and more when not pinned
(`unpinned`); a NIC's first WRITE costs `first_contact_ms` unless warmed up.
A refused post (EAGAIN) is not charged: eager and lazy posting differ only
in when a freed place is filled again.

The round of a thread depends on how many WRITEs it posts per visit, which
depends on the rate: the feasible rates form an interval [0, best], found by
bisection. Everything is analytic; units are in the names (us: microseconds).
"""
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Machine:
    """The hardware: how many links, how fast, how many WRITEs each holds."""
    gpus: int
    nics_per_gpu: int
    link_gbps: float            # one NIC's link speed
    efficiency: float = 1.0     # share of the link speed one NIC delivers at best
    numa_nodes: int = 1         # a GPU's thread runs on its GPU's node
    inflight: float = math.inf  # WRITEs a NIC holds in flight
    latency_us: float = 0.0     # from the post to the completion, beyond the wire time


@dataclass(frozen=True)
class Costs:
    """CPU time of one thread, in microseconds, and two factors."""
    post_us: float = 0.0    # one fi_writemsg the NIC accepts
    visit_us: float = 0.0   # one visit to a NIC: fi_cq_read and the queue's bookkeeping
    atomic_us: float = 0.0  # one update of a counter every thread shares: its line's trip
    crowd: float = 0.0      # slowdown for each other busy thread on the socket: 1 + crowd x (n - 1)
    unpinned: float = 1.0   # factor on every cost when the scheduler moves threads around
    first_contact_ms: float = 0.0  # extra time of a NIC's first WRITE, when not warmed up


@dataclass(frozen=True)
class Layout:
    """How a chapter drives the machine."""
    gpus: int = None             # GPUs used (None: all of the machine's)
    nics_per_gpu: int = None     # NICs per GPU used (None: all)
    threads_per_gpu: int = 0     # 0: one thread visits every NIC
    pinned: bool = True
    shared_counter: bool = False  # every thread updates one counter per WRITE (an atomic)
    batch: int = 1               # new WRITEs per NIC per visit, at most
    lazy: bool = False           # refill a NIC right after reaping (True), or at the next visit
    warmup: bool = True          # first contact happens before the clock starts
    page: int = 64 << 10         # bytes per WRITE
    ops: int = 32_000_000        # WRITEs in the run


@dataclass(frozen=True)
class Result:
    gbps: float
    mpps: float
    limit: str            # what sets the pace: link, cpu, queue or shared counter
    line_gbps: float      # sum of the link speeds used
    round_us: float       # one thread's round of its NICs at that rate
    per_visit: float      # WRITEs posted per NIC visit at that rate

    @property
    def percent(self):
        return 100 * self.gbps / self.line_gbps


def wire_us(machine, page):
    """Time one WRITE of `page` bytes occupies the link."""
    return 8 * page / (machine.link_gbps * 1e3)


def throughput(machine, costs, layout):
    gpus = layout.gpus or machine.gpus
    nics = gpus * (layout.nics_per_gpu or machine.nics_per_gpu)
    threads = gpus * layout.threads_per_gpu or 1
    if nics % threads:
        raise ValueError(f"{nics} NICs do not split evenly among {threads} threads")
    per_thread = nics // threads  # NICs each thread visits
    per_node = threads / min(machine.numa_nodes, gpus) if layout.threads_per_gpu else 1
    slow = (1 + costs.crowd * (per_node - 1)) * (1 if layout.pinned else costs.unpinned)
    atomic_us = costs.atomic_us * (1 if layout.pinned else costs.unpinned) \
        if layout.shared_counter and threads > 1 else 0.0  # alone, the line stays in its cache
    wire = wire_us(machine, layout.page)

    def round_us(x):
        """One thread's round of its NICs when each carries x WRITEs per us: a visit costs
        visit_us, plus post_us (and the shared update) per WRITE it posts, x * round of them;
        round = per_thread * (visit + x * round * post), solved for round."""
        busy = 1 - per_thread * x * (slow * costs.post_us + atomic_us)
        return per_thread * slow * costs.visit_us / busy if busy > 0 else math.inf

    def first_broken(x):  # the first limit that rate x exceeds, or None
        r = round_us(x)
        if x > machine.efficiency / wire:
            return "link"
        if x * r > layout.batch:
            return "cpu"
        held = wire + machine.latency_us + (0.5 if layout.lazy else 1.5) * r
        if x * held > machine.inflight:
            return "queue"
        if atomic_us and nics * x * atomic_us > 1:
            return "shared counter"
        return None

    lo, hi = 0.0, machine.efficiency / wire * (1 + 1e-9)
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if first_broken(mid) is None else (lo, mid)
    x = lo
    steady_s = layout.ops / (nics * x) / 1e6
    first_s = 0 if layout.warmup else per_thread * costs.first_contact_ms / 1e3
    elapsed = steady_s + first_s
    return Result(gbps=8 * layout.page * layout.ops / elapsed / 1e9,
                  mpps=layout.ops / elapsed / 1e6, limit=first_broken(hi),
                  line_gbps=nics * machine.link_gbps, round_us=round_us(x),
                  per_visit=x * round_us(x))

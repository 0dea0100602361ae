"""What every MoE chapter runs around its all-to-all: the layer's arguments, the checks
against the reference, the latency benchmark and its JSON record. An all-to-all is an
object with dispatch_send / dispatch_recv / combine_send / combine_recv, its layout `L`,
its memory `mem`, `wire`, `xp` and `proxy` (None on one node); chapters 16 and 17 build one.
"""
import argparse
import os
import struct
import time

import numpy as np

from common import bench, cli
from common.gpu import rounding
from common.moe import reference as ref
from common.moe.bookkeeping import check_shape
from common.fabric import lib
import common.fabric as fi


def add_arguments(p):
    """The layer's shape and the run's flags, the same in every MoE chapter."""
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per rank, at most")
    p.add_argument("--tokens", type=token_list, help="tokens per rank in the benchmark, "
                   "one run each, e.g. 1,8,128 (default: the maximum)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--dispatch-dtype", choices=["fp8", "bf16"], default="fp8",
                   help="the benchmark's (the checks run both)")
    p.add_argument("--combine-dtype", choices=["bf16"], default="bf16",
                   help="what expert outputs travel back as (bf16, summed in float32)")
    p.add_argument("--private-tokens", type=int, default=8,
                   help="tokens per sender that travel with the counts (default 8)")
    p.add_argument("--check", default="all", help="cases to check: all, none, or some of "
                   + ", ".join(ref.CASES))
    p.add_argument("--nics", type=int, help="NICs per rank for its proxy: the first that "
                   "many of its GPU's (default: all, chapter 08's topology); where no NIC has "
                   "a PCI address, that many virtual NICs (default 1)")
    p.add_argument("--iters", type=int, default=20, help="benchmark iterations (0: none)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, help="inputs of the checks (default: fresh ones)")
    p.add_argument("--world", type=int, help="expect this many ranks (refuse otherwise)")
    p.add_argument("--json", nargs="?", const="auto", help="rank 0 writes the benchmark "
                   "as JSON to this file (default results/runs/<chapter>-...json)")


def check_arguments(args, place):
    """Refuse bad flags in one line, before anything is opened; fill in the defaults."""
    args.tokens = [args.max_tokens] if args.tokens is None else args.tokens
    args.seed = int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed
    cases = list(ref.CASES) if args.check == "all" else [] if args.check == "none" \
        else args.check.split(",")
    if set(cases) - set(ref.CASES):
        raise cli.UsageError(f"--check: unknown case(s) {', '.join(set(cases) - set(ref.CASES))}"
                             f" (cases: {', '.join(ref.CASES)})")
    args.cases = cases
    if args.world is not None and args.world != place.world:
        raise cli.UsageError(f"--world {args.world}, but this job has {place.world} "
                             f"rank{'s' if place.world > 1 else ''} ({place.source})")
    for tokens in args.tokens:
        if not 0 <= tokens <= args.max_tokens:
            raise cli.UsageError(f"--tokens {tokens}: more than --max-tokens "
                                 f"{args.max_tokens} (or negative)")
    if args.nics is not None and not 1 <= args.nics <= 64:
        raise cli.UsageError(f"--nics must be 1..64, not {args.nics}")
    if args.provider:  # only the proxies use it (peers on other nodes); a wrong one is said anyway
        try:
            fi.pick(args.provider, lib.FI_MSG | lib.FI_RMA)
        except ValueError as e:
            raise cli.UsageError(str(e)) from None
    try:
        check_shape(place.world, args.max_tokens, args.experts, args.topk, args.hidden,
                    args.dispatch_dtype, args.private_tokens, args.combine_dtype)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    if "empty-expert" in cases and args.topk >= args.experts:
        raise cli.UsageError("the empty-expert check needs --topk < --experts")
    args.dtypes = ["fp8", "bf16"]


def run(group, args, builds):
    """The checks of each build {name: (own, dtype, private) -> all-to-all}, then its
    benchmark at each --tokens. Returns rank 0's rows of figures and the provider."""
    for name, build in builds.items() if args.cases else ():
        run_checks(build, group, args, args.cases, "" if name == "ours" else name + " ")
    rows, provider = [], None
    for name, build in builds.items() if args.iters else ():
        with fi.Closer() as own:
            a2a = build(own, args.dispatch_dtype, args.private_tokens)
            provider = say_provider(a2a, group) or provider
            for tokens in args.tokens:
                rows.append(benchmark(a2a, group, args, tokens, name))
            group.barrier()
    return rows, provider


def say_world(group, source, how, far):
    """Rank 0 says who runs (`source`: who started the ranks), where, and how the bytes
    move on one node (`how`) and, with several, to the others (`far`)."""
    if group.rank == 0:
        where = f"{group.nodes} emulated nodes of {group.ranks_per_node}" \
            if group.nodes > 1 else "one node"
        print(f"{group.world} ranks ({source}), {where}; {how}"
              + (f"; other nodes: {far}" if group.nodes > 1 else ""), flush=True)


def say_provider(a2a, group):
    """Rank 0 says which provider and NICs the proxy uses; returns the provider (None on
    one node, where no proxy runs)."""
    if not a2a.proxy:
        return None
    if group.rank == 0:
        print(f"provider: {a2a.proxy.provider}; proxy of rank 0: {a2a.proxy.nics}", flush=True)
        if a2a.proxy.provider == "efa":
            print(fi.SHM_OFF, flush=True)
    return a2a.proxy.provider


def write(group, args, chapter, rows, provider, extra=None):
    """--json: rank 0 writes the rows of figures as a record; `extra`, the chapter's own
    fields (how it ran)."""
    rows = [r for r in rows if r is not None]
    if args.json and group.rank == 0 and rows:
        path = bench.run_path(args.json, chapter, args.device, f"{group.world}ranks",
                              f"{group.nodes}nodes")
        print(f"result: {record(path, chapter, args, group, provider, rows, extra)}",
              flush=True)


# --- the checks: every rank computes every rank's input from the seed, so each checks
# what it received against the reference alone; the verdicts are gathered on rank 0 ---
def case_inputs(L, rank, dtype, case, seed, tokens=None):
    """One round of `case` for `rank`: (x, indices, weights, expert outputs, what must
    arrive). Every rank can compute every rank's input from the seed; the experts are
    x -> factor(e) * x, on what should arrive, with a row more for every row a rank may
    be handed (the buffers, or wrong counts)."""
    tokens = L.max_tokens if tokens is None else tokens
    routing = [ref.routing(case, seed, r, L.world, tokens, L.experts, L.topk)
               for r in range(L.world)]
    inputs = [ref.tokens(seed, r, len(routing[r][0]), L.hidden) for r in range(L.world)]
    indices, weights = routing[rank]
    sent = [r[0] for r in routing]
    expected, expected_counts = ref.dispatch(rank, L.world, L.experts, sent,
                                             [ref.wire_rows(dtype, x) for x in inputs])
    trips = [ref.round_trip(dtype, x) for x in inputs]  # what each rank's tokens become
    values, _ = ref.dispatch(rank, L.world, L.experts, sent, trips)
    first = rank * L.local
    experts = np.repeat(np.arange(first, first + L.local), expected_counts)
    answers = np.zeros((L.world * L.per_peer, L.hidden), np.float32)
    answers[:len(values)] = ref.expert_factor(experts, L.experts).astype(np.float32)[:, None] \
        * values
    factors = [ref.expert_factor(indices[:, j], L.experts)[:, None].astype(np.float32)
               for j in range(L.topk)]
    wanted = np.stack([rounding.from_bf16(rounding.to_bf16(f * trips[rank])) for f in factors],
                      axis=1)
    want = ref.combine(indices, weights, wanted)
    return inputs[rank], indices, weights, answers, (expected, expected_counts, want)


def verdict(case, counts, tokens, scales, out):
    """(ok, what this rank saw) of a round of `case` (case_inputs), from host arrays:
    the counts per local expert, the tokens and scales received (the buffers may hold
    more rows than arrived) and combine's output."""
    expected, expected_counts, want = case[4]
    counts = np.asarray(counts).astype(np.int64)
    n = int(counts.sum())  # the rows received
    got = np.asarray(tokens[:n]).view(np.uint8)
    if scales is not None:
        got = np.concatenate([got, np.asarray(scales[:n]).view(np.uint8)], axis=1)
    counts_ok = np.array_equal(counts, expected_counts)
    rows_ok = counts_ok and got.shape == expected.shape and np.array_equal(got, expected)
    error = float(np.abs(out - want).max()) if out.size else 0.0
    tolerance = 2.0 ** -8 * max(1.0, float(np.abs(want).max()) if want.size else 1.0)
    ok = counts_ok and rows_ok and error <= tolerance
    return ok, {"received": n, "counts": counts_ok, "rows": rows_ok, "error": error,
                "tolerance": tolerance}


def check_case(a2a, case, seed):
    """One round of dispatch and combine for `case`: (ok, what this rank saw). Everything
    the GPU needs is on it before the round and everything is read back after it: with
    counts on the device, the host makes no blocking CUDA call in between (chapter 17)."""
    L, xp, host = a2a.L, a2a.xp, a2a.mem.host
    inputs = case_inputs(L, a2a.group.rank, a2a.wire.dtype, case, seed)
    x, chosen, weighed, answers = (xp.asarray(a) for a in inputs[:4])
    a2a.dispatch_send(x, chosen)
    tokens, scales, counts = a2a.dispatch_recv()
    a2a.combine_send(answers[:len(tokens)])
    out = host(a2a.combine_recv(weighed))
    return verdict(inputs, host(counts), host(tokens),
                   None if scales is None else host(scales), out)


def agreed_seed(group, args):
    """Rank 0's --seed (or fresh one): every rank computes every rank's inputs from it."""
    return int.from_bytes(group.allgather(struct.pack("<Q", args.seed))[0], "little")


def run_checks(build, group, args, cases, name=""):
    """Each case on fresh random inputs, for each dtype; rank 0 says what all saw."""
    seed = agreed_seed(group, args)
    # our overflow case shrinks the private slots (the baseline has none)
    private_of = {c: 1 if c == "overflow" and not name else args.private_tokens for c in cases}
    failed = 0
    for dtype in args.dtypes:
        for private in sorted(set(private_of.values())):
            with fi.Closer() as own:
                a2a = build(own, dtype, private)
                for case in [c for c in cases if private_of[c] == private]:
                    ok, seen = check_case(a2a, case, seed)
                    verdicts = [struct.unpack("<?Qdd", v) for v in group.allgather(
                        struct.pack("<?Qdd", ok, seen["received"], seen["error"],
                                    seen["tolerance"]))]
                    bad = [r for r, v in enumerate(verdicts) if not v[0]]
                    failed += bool(bad)
                    if group.rank == 0:
                        received = sum(v[1] for v in verdicts)
                        worst = max(v[2] for v in verdicts)
                        print(f"check {name}{dtype} {case:<12} private {private}: "
                              f"{received} (token, expert) rows received, counts exact and "
                              f"each row once{' with its scales' if dtype == 'fp8' else ''} on "
                              f"{group.world - len(bad)} of {group.world} ranks; combine "
                              f"max |error| {worst:.2e} (bf16 tolerance "
                              f"{max(v[3] for v in verdicts):.2e})"
                              + (f"; FAILED on ranks {bad}" if bad else ""), flush=True)
                    if not ok:
                        print(f"rank {group.rank}: {case}: {seen}", flush=True)
                group.barrier()  # every WRITE completed everywhere before endpoints close
    if failed:
        raise ValueError(f"{failed} checks failed (seed {seed}: --seed {seed} repeats them)")
    if group.rank == 0:
        print(f"all checks passed (seed {seed})", flush=True)


PHASES = ("dispatch send", "dispatch recv", "dispatch", "combine send", "combine recv",
          "combine")


def benchmark(a2a, group, args, tokens, name):
    """Time `tokens` tokens per rank; rank 0 prints and returns a row of figures."""
    L = a2a.L
    indices, weights = ref.routing("random", args.seed, group.rank, L.world, tokens,
                                   L.experts, L.topk)
    xp, mem = a2a.xp, a2a.mem
    x, indices, weights = (xp.asarray(a) for a in (
        ref.tokens(args.seed, group.rank, tokens, L.hidden), indices, weights))
    expert_out = xp.zeros((L.world * L.per_peer, L.hidden), xp.float32)
    if group.rank == 0:
        print(f"benchmark {name}: {tokens} tokens per rank, hidden {L.hidden}, top-{L.topk} of "
              f"{L.experts} experts, {a2a.wire.dtype} dispatch ({L.row} B per row) / "
              f"bf16 combine ({L.out_row} B); {args.iters} iterations after {args.warmup}",
              flush=True)
    times = []
    mem.ready()
    group.barrier()  # once: from then on each round's combine-recv, which waits for every
    # peer, lines the ranks up for the next, as layer follows layer in a model (a host
    # barrier per round let them start up to 90 us apart on 2 x H200: rank 0 hosts the
    # rendezvous; the receive halves counted that as latency)
    for i in range(args.warmup + args.iters):
        t0 = mem.mark()  # the machine's clock, or CUDA events on the rank's stream
        a2a.dispatch_send(x, indices)
        t1 = mem.mark()
        received, scales, counts = a2a.dispatch_recv()
        t2 = mem.mark()
        a2a.combine_send(expert_out[:len(received)])
        t3 = mem.mark()
        a2a.combine_recv(weights)
        t4 = mem.mark()
        if i >= args.warmup:
            t = [mem.seconds(a, b) for a, b in ((t0, t1), (t1, t2), (t2, t3), (t3, t4))]
            times.append((t[0], t[1], t[0] + t[1], t[2], t[3], t[2] + t[3]))
    mine = struct.pack(f"<{len(PHASES)}d", *np.median(np.array(times), axis=0))
    every = np.array([struct.unpack(f"<{len(PHASES)}d", b) for b in group.allgather(mine)])
    if group.rank:
        return None
    if a2a.proxy:
        print(f"proxy of rank 0: {a2a.proxy.p.posted} WRITEs, -FI_EAGAIN {a2a.proxy.p.eagain} "
              "times")
    print("latency, the median of each rank, then across ranks:")
    rows = tokens * L.topk
    sizes = {"dispatch": rows * L.row, "combine": rows * L.out_row}
    figures = {"implementation": name, "tokens": tokens, "rows": rows,
               "dispatch_bytes": sizes["dispatch"], "combine_bytes": sizes["combine"]}
    for phase, col in zip(PHASES, every.T):
        p50, worst = float(np.median(col)), float(col.max())
        key = phase.replace(" ", "_")
        figures[f"{key}_p50_us"], figures[f"{key}_max_us"] = 1e6 * p50, 1e6 * worst
        line = f"  {phase:<14} p50 {1e6 * p50:9.1f} us   max {1e6 * worst:9.1f} us"
        if phase in sizes:
            figures[f"{key}_gb_per_s"] = sizes[phase] / p50 / 1e9
            line += (f"   {sizes[phase] / p50 / 1e9:.3f} GB/s ({rows} rows x "
                     f"{sizes[phase] // max(rows, 1)} B / p50)")
        print(line, flush=True)
    return figures


def record(path, chapter, args, group, provider, rows, extra=None):
    """The benchmark as JSON: what ran, where, and a row per (implementation, tokens)."""
    data = {"chapter": chapter, "args": bench.arguments(), "device": args.device,
            **(extra or {}), "world": group.world,
            "ranks_per_node": group.ranks_per_node,
            "provider": provider, "libfabric": "%d.%d" % fi.version(),
            "machine": bench.machine(0 if args.device == "cuda" else None),
            "git": bench.git_sha(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "shape": {"hidden": args.hidden, "experts": args.experts, "topk": args.topk,
                      "dispatch": args.dispatch_dtype, "combine": args.combine_dtype,
                      "private_tokens": args.private_tokens},
            "runs": rows}
    return bench.write_json(path, data)


def token_list(text):
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tokens takes numbers like 1,8,128, got '{text}'") \
            from None

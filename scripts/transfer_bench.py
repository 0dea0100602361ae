"""The transfer engine's benchmark: rank 0 writes paged WRITEs into rank 1, which expects them.

Two processes (this script starts them through common/launch, or run it under
scripts/launch.py -n 2). For each page size and page count, rank 0 hands the engine's
worker one write_pages of that many pages, every WRITE with the same immediate, and
times it from the call to its last completion (the series counts on the writer); rank 1
expects that many immediates, then says "ready" for the next repeat. The median of the
repeats is reported as Gbps and Mpps, next to fabtests' `fi_rma_bw -o writedata` at each
size on the same provider (the median of as many runs), measured in the same run where it
is found (bench.tools_prefix). Each size's data is checked once (seeded pages, wrong bytes
counted). For the median repeat it also says where the time went (Transfer.phases): Python
building the command, the worker picking it up, posting its WRITEs, the last completion
coming, Python seeing it; and each repeat's whole cost, from rank 0's call to rank 1's
expect returning (`whole`, both clocks CLOCK_MONOTONIC of this host).

With --gpu both ranks' pages are in that GPU's memory, and rank 0 reaches rank 1 by the
engine's CUDA IPC route (one kernel a command, common/transfer/ipc.py) unless
--no-cuda-ipc sends them by libfabric; the first line says which. Then each case is also
measured against the same GPU's ceiling in the same run (common/baselines.gather_ceiling):
the route's kernel gathering the same pages in one process (the GPU's time, and from the
call to its mark), CUDA's batched copy of the same pages (cuMemcpyBatchAsync), and one
contiguous device copy of as many bytes.

    .venv/bin/python scripts/transfer_bench.py -p shm
    .venv/bin/python scripts/transfer_bench.py -p tcp --page-sizes 4K,64K --pages 100 --repeats 5 --json
    .venv/bin/python scripts/transfer_bench.py -p shm --nics 2 --spread per-peer
    .venv/bin/python scripts/transfer_bench.py -p shm --page-sizes 4K,16K --window 64 --inject
    .venv/bin/python scripts/transfer_bench.py -p shm --page-sizes 4K --pages 1000 --stream 8
    .venv/bin/python scripts/transfer_bench.py -p shm --nixl /path/to/python-with-nixl --json
    .venv/bin/python scripts/transfer_bench.py -p shm --gpu 0      # GPU memory (both ranks)
    .venv/bin/python scripts/transfer_bench.py -p shm --gpu 0 --no-cuda-ipc   # by libfabric

--stream K: rank 0 makes K such commands back to back in each repeat and waits for them
once, as a stream of KV-cache pages does: the host's work on one command then overlaps the
previous one's WRITEs or kernel. Gbps count all K; the phases are the last command's; the
ceiling is K kernels.

--prepared: rank 0 makes each case's command once, outside the clock
(Engine.prepare_pages: its pages checked, on the CUDA IPC route its table put on the GPU),
and each repeat writes it (Prepared.write: one launch), as a KV cache's layers are sent.
The data check of each size goes through a prepared command too.

--resident (with --prepared): Engine(resident=True): a command of at most 4 chunks of
8 KiB per SM goes to a kernel that stays on the GPU while commands come, not a launch.
It leaves the GPU (Engine.rest) before the ceiling is measured.

--inject: rank 0 injects every WRITE of at most the provider's inject size (4 KiB on shm;
write_pages(inject=True)), as fi_rma_bw does. Its clock then stops once the last WRITE is
posted, before the last ones have landed; so it did without --inject on shm, which writes
a WRITE's completion as it posts it up to 4 KiB (prov/shm/src/smr_rma.c smr_generic_rma).
Delivery is what rank 1 waits for: every immediate of a repeat before the next one starts,
and the bytes, checked once per size.

--nixl runs scripts/nixl_pages.py with that interpreter on the same cases in the same run,
in the same memory (with --gpu N, NIXL's two regions in GPU N's memory too, registered as
VRAM; a NIXL that cannot is "not measured", never host memory in its place), and says each
case's ratio to NIXL.

What it measured on our machines, and why each gap to fi_rma_bw or NIXL is what it is (the
bytes touched, the completion per WRITE): results/transfer/README.md.
"""
import argparse
import os
import sys
import time

import numpy as np

from common import cli, launch, usage
from common.patience import patience

CAP = 1 << 26  # bytes of each side's buffer at most: 10,000 pages of 64 KiB wrap around in it


def parse():
    from common import cli
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("-p", "--provider", default=None)
    p.add_argument("--page-sizes", default="1K,4K,8K,16K,64K",
                   help="comma-separated sizes (K/M/G)")
    p.add_argument("--pages", default="100,10000", help="comma-separated page counts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--spread", default="round-robin", choices=["round-robin", "per-peer"])
    p.add_argument("--window", type=int, help="the WRITEs cycle over this many pages at each "
                   "end, and fi_rma_bw runs with -W of it: both touch the same bytes (by "
                   "default ours touch up to 64 MiB a side, fi_rma_bw its 64 messages)")
    p.add_argument("--stream", type=cli.count(1, 256), default=1, help="commands in flight "
                   "in each repeat: rank 0 makes them back to back and waits once, as a "
                   "stream of KV-cache pages does (default 1: each command alone)")
    p.add_argument("--inject", action="store_true", help="rank 0 injects each WRITE of at "
                   "most the provider's inject size (no completion; write_pages(inject=True))")
    p.add_argument("--prepared", action="store_true", help="rank 0 makes each case's "
                   "command once (Engine.prepare_pages) and writes it in every repeat")
    p.add_argument("--resident", action="store_true", help="with --prepared: small "
                   "commands go to a kernel that stays on the GPU (Engine(resident=True))")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--no-fabtests", action="store_true", help="skip fi_rma_bw")
    p.add_argument("--nixl", metavar="PYTHON", help="also move the same pages with NIXL "
                   "(scripts/nixl_pages.py run by this interpreter, one that has nixl), in "
                   "the same run, in GPU memory with --gpu")
    p.add_argument("--gpu", type=int, help="both ranks' pages in this GPU's memory (cupy), "
                   "fi_rma_bw with -D cuda on it too")
    cli.add_engine(p)
    p.add_argument("--json", nargs="?", const="auto", help="write a record (results/runs/...)")
    args = p.parse_args()
    try:
        args.sizes = [cli.parse_size(s) for s in args.page_sizes.split(",")]
        args.counts = [int(n) for n in args.pages.split(",")]
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    if min(args.repeats, *args.counts, *args.sizes, 1 if args.window is None else args.window) < 1:
        p.error("--repeats, --pages, --page-sizes and --window must be positive")
    if args.resident and not (args.prepared and args.gpu is not None):
        p.error("--resident is for prepared commands in GPU memory: with --prepared and --gpu")
    if args.nixl and args.stream > 1:
        p.error("--nixl moves one command at a time: compare it with --stream 1")
    if args.window and args.window * max(args.sizes) > CAP:
        p.error(f"--window {args.window} of {max(args.sizes)}-byte pages is more than the "
                f"{CAP >> 20} MiB buffer")
    return args


def seeded(seed, size):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def rank_main(args):
    import common.fabric as fi
    from common.fabric import memory
    from common.transfer import Engine
    timeout = patience(args.timeout)
    with launch.Group(launch.place_from_environment(), timeout=patience(60)) as group, \
            fi.Closer() as own:
        if group.world != 2:
            raise SystemExit("transfer_bench.py: needs exactly 2 ranks")
        eng = Engine(own, provider=args.provider, gpu=args.gpu, nics=args.nics,
                     spread=args.spread, timeout=timeout, cuda_ipc=not args.no_cuda_ipc,
                     resident=args.resident)
        xp = np if args.gpu is None else memory.cupy()
        eng.watch(group.check)
        me, other = group.rank, 1 - group.rank
        peer = eng.connect(group.allgather(eng.address())[other])
        size = min(CAP, max(args.sizes) * max(args.counts))
        buf = xp.asarray(seeded([5, me], size))
        region = eng.register(buf)
        theirs = eng.remote(group.allgather(region.descriptor())[other])
        if me == 0:
            inject = (f"; injecting WRITEs of up to {eng.inject_size} B" if eng.inject_size else
                      "; --inject, but this provider injects no WRITE here (inject size 0)")
            print(f"provider: {eng.provider}; {eng.nics}; spread {args.spread}"
                  + (inject if args.inject else ""), flush=True)
            print(f"route: {peer.route} ({peer.why})", flush=True)
        rows, imm = [], 0

        def write(src, dst, page):
            """The command of these pages, as a function of its immediate."""
            if args.prepared:
                return eng.prepare_pages(peer, region, src, theirs, dst, page,
                                         inject=args.inject).write
            return lambda imm: eng.write_pages(peer, region, src, theirs, dst, page, imm=imm,
                                               inject=args.inject)
        for page in args.sizes:
            slots = size // page
            # checked once per size: seeded pages, in another order, no wrap
            n = min(slots, 1000)
            order = np.random.default_rng(page).permutation(n)
            imm += 1
            if me == 0:
                write(np.arange(n), order, page)(imm).wait()
                _, said = eng.recv(timeout)
                wrong = int(said.decode().split()[1])
            else:
                eng.expect(imm, n, timeout)
                sent = xp.asarray(seeded([5, 0], size)[:n * page].reshape(n, page))
                wrong = int(xp.count_nonzero(buf[:slots * page].reshape(slots, page)[order]
                                             != sent))
                eng.send(peer, f"wrong {wrong}".encode())
            for count in args.counts:
                imm += 1
                span = min(args.window or slots, slots)
                src = np.arange(count) % span
                dst = np.random.default_rng(count).permutation(count) % span
                times, phases, wholes = [], [], []
                command = write(src, dst, page) if me == 0 else None
                for _ in range(args.repeats):
                    if me == 0:
                        eng.recv(timeout)  # rank 1: ready
                        before = eng.stats()
                        started = time.monotonic_ns()
                        stream = []
                        for _ in range(args.stream):  # each call returns once queued
                            called = time.monotonic_ns()
                            stream.append(command(imm))
                        for t in stream:
                            t.wait()
                        ended = time.monotonic_ns()
                        times.append((ended - started) * 1e-9)
                        phases.append(t.phases(called, ended))  # the last command's
                        after = eng.stats()
                        refused = after["eagain"] - before["eagain"]
                        injected = after["injected"] - before["injected"]
                        seen = int(eng.recv(timeout)[1].split()[1])  # rank 1's expect returned
                        wholes.append((seen - started) * 1e-9)
                    else:
                        eng.send(peer, b"ready")
                        eng.expect(imm, count * args.stream, timeout)
                        eng.send(peer, f"seen {time.monotonic_ns()}".encode())
                if me == 0:
                    elapsed = float(np.median(times))
                    median = phases[int(np.argsort(times)[len(times) // 2])]
                    moved = count * args.stream  # pages in a repeat
                    rows.append({"page_size": page, "pages": count, "repeats": args.repeats,
                                 "stream": args.stream, "elapsed_s": elapsed,
                                 "gbps": 8 * moved * page / elapsed / 1e9,
                                 "mpps": moved / elapsed / 1e6, "wrong_bytes": wrong,
                                 "eagain_last": refused, "injected_last": injected,
                                 "phases_s": median, "whole_s": float(np.median(wholes)),
                                 "route": peer.route, "prepared": args.prepared,
                                 "resident": args.resident})
                    r = rows[-1]
                    streamed = f" x {args.stream} commands" if args.stream > 1 else ""
                    print(f"{page:>6} B x {count:>5} pages{streamed}: {r['gbps']:8.3f} Gbps "
                          f"{r['mpps']:7.3f} Mpps (median of {args.repeats}; {wrong} wrong "
                          f"bytes; {refused} refusals, {injected} injected in the last)",
                          flush=True)
                    last = " (its last command)" if args.stream > 1 else ""
                    took = 1e6 * sum(median.values())
                    print(f"{'':>6}   the median repeat{last}, {took:.0f} us: "
                          + ", ".join(f"{name} {1e6 * took:.0f}" for name, took in median.items())
                          + f"; whole (to rank 1's expect) {1e6 * r['whole_s']:.0f} us",
                          flush=True)
                    if args.gpu is not None:
                        eng.rest()  # every SM for the ceiling's kernel
                        ceiling(r, args.gpu, page, src, dst, size, args.repeats)
        group.barrier()
        if me == 0:
            return rows, eng.provider
    return None, None


def ceiling(row, gpu, page, src, dst, size, repeats):
    """The same pages on the same GPU in this process (baselines.gather_ceiling), into
    `row`, and how the route compares."""
    from common import baselines
    c = baselines.gather_ceiling(gpu, page, src, dst, size, max(repeats, 3))
    bits = 8 * len(src) * page
    kernels = c["gather_kernel_s"] * row["stream"]  # one kernel's time per command
    row.update(c, gather_gbps=bits / c["gather_kernel_s"] / 1e9,
               device_copy_gbps=bits / c["device_copy_s"] / 1e9,
               percent_of_gather=100 * kernels / row["elapsed_s"],
               whole_per_gather_kernel=row["whole_s"] / kernels)
    batch = "no cuMemcpyBatchAsync in this driver"
    if c["batch_call_s"]:
        row["batch_gbps"] = bits / c["batch_call_s"] / 1e9
        batch = (f"cuMemcpyBatchAsync {row['batch_gbps']:.0f} Gbps "
                 f"({1e6 * c['batch_call_s']:.1f} us from the call)")
    print(f"{'':>6}   on this GPU: the gather kernel {row['gather_gbps']:.0f} Gbps "
          f"({1e6 * c['gather_kernel_s']:.1f} us; {1e6 * c['gather_call_s']:.1f} us from "
          f"the call), {batch}, one device copy {row['device_copy_gbps']:.0f} Gbps; this "
          f"route {row['percent_of_gather']:.1f}% of the gather, whole "
          f"{row['whole_per_gather_kernel']:.1f}x its kernel"
          + (f"s ({row['stream']} commands)" if row["stream"] > 1 else ""), flush=True)


def fabtests(provider, sizes, timeout, gpu=None, repeats=1, window=None):
    """{size: Gbps} of fi_rma_bw -o writedata, the median of `repeats` runs (one run on a
    2-core VM gave 15 to 84 Gbps at 4 KiB), or None with one line saying how to get it."""
    from common import baselines
    try:
        baselines.rma_bw_tool()
    except FileNotFoundError as e:
        print(f"fi_rma_bw: not measured: {e}", flush=True)
        return None
    out = {}
    for size in sizes:
        runs = []
        for _ in range(repeats):
            try:
                gbps, command = baselines.fi_rma_bw(provider, "writedata", size,
                                                    baselines.iterations(size, 1 << 30),
                                                    None if gpu is None else (gpu, gpu), timeout,
                                                    window)
            except Exception as e:  # a failed run costs its figure, not the others
                print(f"fi_rma_bw {size}: failed: {str(e).splitlines()[0]}", flush=True)
                continue
            runs.append(gbps)
        if not runs:
            continue
        out[size] = float(np.median(runs))
        print(f"fi_rma_bw -o writedata {size:>6} B: {out[size]:8.3f} Gbps (median of {len(runs)}: "
              f"{' '.join(f'{g:.1f}' for g in runs)}; {command})", flush=True)
    return out


def nixl_env():
    """The environment nixl_pages.py runs in: a python of NIXL's own has not installed this
    repository, so the repository goes on its PYTHONPATH (for common/)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))


def nixl(python, args, timeout):
    """NIXL's rows {(page size, pages): row} for the same cases, or None with one line."""
    import json
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "nixl.json")
        done = subprocess.run(
            [python, os.path.join(os.path.dirname(os.path.abspath(__file__)), "nixl_pages.py"),
             "--page-size", ",".join(map(str, args.sizes)),
             "--pages", ",".join(map(str, args.counts)), "--repeats", str(args.repeats),
             *([] if args.gpu is None else ["--gpu", str(args.gpu)]),  # the same memory as ours
             "--json", out], capture_output=True, text=True, timeout=timeout,
            env=nixl_env())
        if done.returncode:
            print(f"nixl: not measured: {(done.stderr or done.stdout).strip().splitlines()[-1]}",
                  flush=True)
            return None
        record = json.loads(open(out).read())
    print(done.stdout.rstrip(), flush=True)
    return {(r["page_size"], r["pages"]): r for r in record["runs"]}


def main():
    args = parse()
    if "RANK" not in os.environ:  # start the two ranks, then measure the limit
        rc = launch.spawn([__file__, *sys.argv[1:]], 2)
        return rc
    rows, provider = rank_main(args)
    if rows is None:
        return 0
    limits = None if args.no_fabtests else fabtests(provider, args.sizes, patience(120), args.gpu,
                                                    args.repeats, args.window)
    for r in rows:
        lim = (limits or {}).get(r["page_size"])
        r["fi_rma_bw_gbps"] = lim
        r["percent_of_fi_rma_bw"] = 100 * r["gbps"] / lim if lim else None
    if limits:
        for r in rows:
            if r["fi_rma_bw_gbps"]:
                print(f"{r['page_size']:>6} B x {r['pages']:>5}: {r['percent_of_fi_rma_bw']:.1f}% "
                      f"of fi_rma_bw's {r['fi_rma_bw_gbps']:.3f} Gbps", flush=True)
    theirs = nixl(args.nixl, args, patience(600)) if args.nixl else None
    for r in rows:
        peer = (theirs or {}).get((r["page_size"], r["pages"]))
        r["nixl_gbps"] = peer["gbps"] if peer else None
        if peer:
            print(f"{r['page_size']:>6} B x {r['pages']:>5}: {r['gbps'] / peer['gbps']:.2f}x "
                  f"NIXL's {peer['gbps']:.3f} Gbps", flush=True)
    if args.json:
        from common import bench
        import common.fabric as fi
        from datetime import datetime, timezone
        path = bench.run_path(args.json, "transfer", provider.split(";")[0])
        data = {"chapter": "transfer", "args": bench.arguments(), "provider": provider,
                "libfabric": "%d.%d" % fi.version(), "machine": bench.machine(args.gpu),
                "git": bench.git_sha(),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "nics": args.nics or 1, "spread": args.spread, "window": args.window,
                "inject": args.inject, "cuda_ipc": args.gpu is not None and not args.no_cuda_ipc,
                "memory": "host" if args.gpu is None else "cuda", "runs": rows}
        print(f"wrote {bench.write_json(path, data)}", flush=True)
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:  # a rank: a failure or a Ctrl-C is one line (common/cli.py)
        cli.run(main)
    sys.exit(main())  # the launcher, as scripts/launch.py: it stops both ranks on a Ctrl-C

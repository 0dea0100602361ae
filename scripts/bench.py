"""Benchmark chapter 07 against the baselines, in the same run, over a sweep of page sizes.

    python scripts/bench.py -p shm --sizes 4K,16K,64K,256K,1M --label my-laptop
    python scripts/bench.py -p shm --sizes 1M,16M --gpus 0,1 --ucx DIR --label h200x2

Each repeat runs the chapter's server and client on this host, then
fi_rma_bw (write and writedata), and on GPUs UCX's put bandwidth and
cudaMemcpyPeer, so that every ratio compares figures taken minutes apart.
The chapter writes 64 distinct pages in a loop, the footprint of fi_rma_bw's
window of 64. Writes results/07_queue/<label>-<provider>-<memory>.json and
results/baselines/<label>-<provider>-<memory>.json.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import baseline_tools, measure, parse, parser, save  # noqa: E402
from pair import run_pair  # noqa: E402

WINDOW = 64  # distinct pages, as fi_rma_bw's default window


def chapter_07(provider, size, iters, gpus, timeout):
    """One run of chapter 07 as a pair; the server's Gbps, from its --json record."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        server = ["--clients", "1", "--json", str(out)]
        client = ["--page-size", str(size), "--buffers", "1", "--buffer-size", str(WINDOW * size),
                  "--pages", f"0-{WINDOW - 1}", "--iters", str(iters), "--timeout", "30"]
        if gpus:
            server += ["--gpu", str(gpus[0])]
            client += ["--gpu", str(gpus[1])]
        pair = run_pair(7, provider, server, [client], timeout=timeout)
        if not pair.ok or not out.exists():
            failed = next((r for r in [*pair.clients, pair.server] if r.rc), pair.server)
            raise RuntimeError(f"chapter 07 failed: {(failed.err or failed.out).strip()[-300:]}")
        return json.loads(out.read_text())["gbps"], " ".join(client)


def main():
    p = parser(__doc__)
    p.add_argument("--ucx", help="unpacked libucx-cu13 wheel, for ucx_perftest (GPU only)")
    args = parse(p)
    tools = [("chapter 07", lambda size, iters: chapter_07(args.provider, size, iters, args.gpus,
                                                           args.timeout))]
    tools += baseline_tools(args.provider, args.gpus, args.ucx, args.timeout)
    try:
        rows = measure(tools, args.sizes, args.repeats, args.bytes)
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as e:
        sys.exit(f"bench: {e}")
    ours = [r for r in rows if r["tool"] == "chapter 07"]
    for row in ours:
        for other in rows:
            if other["size"] == row["size"] and other is not row:
                row[f"ratio_to {other['tool']}"] = round(row["median_gbps"] / other["median_gbps"], 3)
        print(f"  {row['size']:>10} B: chapter 07 / fi_rma_bw -o write = "
              f"{row['ratio_to fi_rma_bw -o write']:.2f}")
    save(ours, "07_queue", args.label, args.provider, args.gpus)
    save([r for r in rows if r not in ours], "baseline", args.label, args.provider, args.gpus)


if __name__ == "__main__":
    main()

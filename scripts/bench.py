"""Benchmark chapters 07 and 09-11 against the baselines, in the same run, over page sizes.

    .venv/bin/python scripts/bench.py -p shm --sizes 4K,16K,64K,256K,1M,4M --label my-laptop
    .venv/bin/python scripts/bench.py -p shm --sizes 1M,16M --gpus 0,1 --ucx DIR --label h200x2
    .venv/bin/python scripts/bench.py -p tcp --sizes 64K --chapters 7,9,10,11 --nics-per-gpu 4 --label my-laptop

Each repeat runs each chapter's server and client on this host, then
fi_rma_bw (write and writedata), and on GPUs UCX's put bandwidth and
cudaMemcpyPeer, so that every ratio compares figures taken minutes apart.
The chapters write 64 distinct pages in a loop, the footprint of fi_rma_bw's
window of 64; 09-11 spread them over --nics-per-gpu NICs (virtual ones on
shm and tcp). With --gpus A,B, chapters 09 on put buffers on both GPUs on
both sides, and each GPU writes to the other one's: every byte crosses
NVLink, both ways at once, against the ceiling of cudaMemcpyPeer both ways.
Writes results/<chapter>/<label>-<provider>-<memory>.json and
results/baselines/<label>-<provider>-<memory>.json. What the run needs is
checked before anything runs; when a later run fails, what was measured is
written.
"""
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baseline import baseline_tools, chapter_list, memcpy_peer, parse, parser, run_all, \
    save  # noqa: E402
from pair import chapter_path, run_pair  # noqa: E402

WINDOW = 64  # distinct pages, as fi_rma_bw's default window


def chapter_args(chapter, size, iters, nics, groups=1, gpus=None, client_gpus=None):
    """The server's and the client's arguments for one run of a chapter (the server's
    --clients and --json aside). Chapters 09 on: `nics` per GPU (None: the chapter's
    default), and with host memory `groups` stand-ins for GPUs. `gpus`: the server's,
    `client_gpus`: the client's (default the same)."""
    client_gpus = client_gpus or gpus
    server = []
    client = ["--page-size", str(size), "--buffers", "1", "--buffer-size", str(WINDOW * size),
              "--pages", f"0-{WINDOW - 1}", "--iters", str(iters), "--timeout", "30"]
    if chapter >= 9:
        client += (["--nics-per-gpu", str(nics)] if nics else []) + \
            ([] if gpus else ["--groups", str(groups)])
    if gpus and chapter < 9:
        server += ["--gpu", str(gpus[0])]
        client += ["--gpu", str(client_gpus[0])]
    elif gpus:
        server += ["--gpus", ",".join(map(str, gpus))]
        client += ["--gpus", ",".join(map(str, client_gpus))]
    return server, client


def run_chapter(chapter, provider, size, iters, gpus, nics, timeout, groups=1):
    """One run of a chapter as a pair; the server's Gbps, from its --json record.
    Chapters 09 on: `nics` per GPU, and with host memory `groups` stand-ins for GPUs.
    With GPUs A,B, 09 on put buffers on both GPUs and each GPU writes to the other:
    all over NVLink."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        server, client = chapter_args(chapter, size, iters, nics, groups, gpus,
                                      gpus and gpus[::-1])
        server += ["--clients", "1", "--json", str(out)]
        pair = run_pair(chapter, provider, server, [client], timeout=timeout)
        if not pair.ok or not out.exists():
            failed = next((r for r in [*pair.clients, pair.server] if r.rc), pair.server)
            raise RuntimeError(f"chapter {chapter:02d} failed: "
                               f"{(failed.err or failed.out).strip()[-300:]}")
        return json.loads(out.read_text())["gbps"], " ".join(client)


def tool_name(chapter, nics, gpus):
    if chapter < 9:
        return f"chapter {chapter:02d}"
    return f"chapter {chapter:02d} ({'2 GPUs x ' if gpus else ''}{nics} NICs)"


def main():
    p = parser(__doc__)
    p.add_argument("--ucx", help="unpacked libucx-cu13 wheel, for ucx_perftest (GPU only)")
    p.add_argument("--chapters", default="7", help="which chapters, e.g. 7,9,10 (default 7)")
    p.add_argument("--nics-per-gpu", type=int, default=4, help="for 09 on (default 4)")
    args = parse(p)
    chapters = chapter_list(p, args.chapters, [7, *range(9, 16)])
    tools = [(tool_name(c, args.nics_per_gpu, args.gpus),
              lambda size, iters, c=c: run_chapter(c, args.provider, size, iters, args.gpus,
                                                   args.nics_per_gpu, args.timeout))
             for c in chapters]
    tools += baseline_tools(args.provider, args.gpus, args.ucx, args.timeout)
    if args.gpus and max(chapters) >= 9:  # the ceiling of 09 on: both directions at once
        pairs = [args.gpus, args.gpus[::-1]]
        tools.append(("cudaMemcpyPeer both ways", lambda size, iters: memcpy_peer(size, iters,
                                                                                  pairs)))
    run_all("bench", args, tools, lambda rows: keep(rows, chapters, args), chapters=True)


def keep(rows, chapters, args):
    """Each chapter's ratios to the baselines of the same run and size; then the files."""
    ours = [r for r in rows if r["tool"].startswith("chapter ")]
    for row in ours:
        for other in rows:
            if other["size"] == row["size"] and not other["tool"].startswith("chapter "):
                row[f"ratio_to {other['tool']}"] = round(row["median_gbps"] / other["median_gbps"], 3)
        if "ratio_to fi_rma_bw -o write" in row:
            print(f"  {row['tool']:<20} {row['size']:>10} B: / fi_rma_bw -o write = "
                  f"{row['ratio_to fi_rma_bw -o write']:.2f}")
    for c in chapters:
        mine = [r for r in ours if r["tool"] == tool_name(c, args.nics_per_gpu, args.gpus)]
        if mine:
            save(mine, chapter_path(c).stem, args)
    if len(ours) < len(rows):
        save([r for r in rows if r not in ours], "baseline", args)


if __name__ == "__main__":
    main()

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
from common import usage
from common.baselines import baseline_tools, chapter_list, memcpy_peer, parse, parser, \
    run_all, run_chapter, save
from common.chapter_pair import chapter_path


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
    usage.run(main)  # Ctrl-C: what runs is stopped, one line, exit 130

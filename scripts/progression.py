"""Chapters 09 to 15 back to back, on one machine with the same arguments: the series' steps, here.

    .venv/bin/python scripts/progression.py -p shm --sizes 64K --label my-laptop
    .venv/bin/python scripts/progression.py -p shm --sizes 64K,1M --gpus 0,1 --label h200x2
    .venv/bin/python scripts/progression.py -p shm --sizes 4K --groups 8 --chapters 13 --label box-8

With --gpus A,B the buffers are on both GPUs on both sides and each GPU
writes to the other's (every byte crosses NVLink, both ways at once); the
baseline is cudaMemcpyPeer both ways. With host memory, --groups stand-ins
for GPUs share the machine, against fabtests' fi_rma_bw -o write (a
baseline, not a limit: on the 2-core VM chapters 13-15 moved 2.3x its
figure). Each repeat runs every chapter, then the baseline, so the figures
of one repeat are minutes apart at most. Writes results/progression/<label>-
<provider>-<memory>.json (per chapter and size: Gbps of each repeat, median,
Mpps, % of the baseline, kept as "percent_of_ceiling"; the baseline also to
results/baselines/) and prints them
beside the series' p5 figures (% of 3200). What the run needs is checked
before anything runs; when a later run fails, what was measured is written.
"""
import json

from common import usage
from common.baselines import chapter_list, fi_rma_bw, memcpy_peer, parse, parser, run_all, \
    run_chapter, save
from common.records import ROOT

CHAPTERS = "9,10,11,12,13,14,15"


def main():
    p = parser(__doc__)
    p.add_argument("--nics-per-gpu", type=int, default=2, help="(virtual) NICs per GPU (2)")
    p.add_argument("--groups", type=int, default=2, help="host memory: GPUs stood in for (2)")
    p.add_argument("--chapters", default=CHAPTERS, help=f"which of them ({CHAPTERS})")
    args = parse(p)
    chapters = chapter_list(p, args.chapters, range(9, 16))
    tools = [(f"chapter {c:02d}", lambda size, iters, c=c: run_chapter(
        c, args.provider, size, iters, args.gpus, args.nics_per_gpu, args.timeout, args.groups))
        for c in chapters]
    if args.gpus:
        pairs = [args.gpus, args.gpus[::-1]]
        ceiling = ("cudaMemcpyPeer both ways", lambda size, iters: memcpy_peer(size, iters, pairs))
    else:
        ceiling = ("fi_rma_bw -o write", lambda size, iters: fi_rma_bw(
            args.provider, "write", size, iters, None, args.timeout))
    run_all("progression", args, tools + [ceiling], lambda rows: keep(rows, ceiling[0], args),
            chapters=True)


def keep(rows, ceiling, args):
    """Print and write the rows; each chapter's % of the ceiling where it was measured."""
    blog = json.loads((ROOT / "results" / "blog_p5.json").read_text())
    print(f"\nbaseline: {ceiling} (what the tool gets here, not a limit); the series' p5: "
          f"% of 3200 Gbps\n"
          f"{'chapter':<12}{'size':>10}{'Gbps':>10}{'Mpps':>9}{'% baseline':>11}{'p5 %':>8}")
    for row in rows:
        limit = next((r for r in rows if r["size"] == row["size"] and r["tool"] == ceiling), None)
        row["mpps"] = round(row["median_gbps"] * 1e9 / 8 / row["size"] / 1e6, 4)
        if limit:
            row["percent_of_ceiling"] = round(100 * row["median_gbps"] / limit["median_gbps"], 1)
            row["ceiling"] = ceiling
        p5 = blog["chapters"].get(row["tool"][-2:], {}).get("gbps")
        if row["tool"].startswith("chapter"):
            share = f"{row['percent_of_ceiling']:>10.1f}%" if limit else f"{'-':>11}"
            print(f"{row['tool']:<12}{row['size']:>10}{row['median_gbps']:>10.1f}"
                  f"{row['mpps']:>9.3f}{share}{100 * p5 / blog['limit_gbps']:>7.1f}%")
    save(rows, "progression", args)
    # the chapters find the ceiling there, to say what share of it a run reaches
    if any(r["tool"] == ceiling for r in rows):
        save([r for r in rows if r["tool"] == ceiling], "baseline", args)


if __name__ == "__main__":
    usage.run(main)  # Ctrl-C: what runs is stopped, one line, exit 130

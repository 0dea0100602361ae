"""The journey, chapter by chapter: the blog's p5 figures, the model's, and ours.

Ours are read from results/<NN_name>/<setup>.json (scripts/bench.py), whichever
chapters and setups exist; each at the series' page size, as a share of the
best baseline (fi_rma_bw, UCX, cudaMemcpyPeer) measured in the same setup at
the same size: results/baselines/<setup>.json. And from results/progression/
(scripts/progression.py: chapters 09-15 back to back), at each size there,
as a share of the baseline measured in the same run. A baseline is what a tool
gets, not a limit: on the 2-core VM (shm, host memory, 64 KiB) chapters 13-15
moved 2.3x what fi_rma_bw -o write moved. (The files keep their key names,
"limit" and "percent_of_ceiling"; the figure calls them baselines.)
"""
import json
import re
from pathlib import Path

PAGE = 64 << 10
OURS = ["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown", "tab:olive",
        "tab:cyan", "tab:pink", "tab:gray", "gold", "navy", "lime"]
CHAPTER = re.compile(r"chapter (\d+)")


def _runs(path):
    try:
        data = json.loads(path.read_text())
        return data, [r for r in data["runs"] if "median_gbps" in r and "size" in r]
    except (OSError, ValueError, KeyError, TypeError):
        return None, []


def measured(results, page=PAGE):
    """{setup: {"machine": ..., "chapters": {"07": {gbps, limit_gbps, limit, percent}}}}"""
    results = Path(results)
    setups = {}
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and re.match(r"\d\d_", p.name)):
        for path in sorted(folder.glob("*.json")):
            data, runs = _runs(path)
            for row in runs:
                match = CHAPTER.match(row.get("tool", ""))
                if match and row["size"] == page:
                    entry = setups.setdefault(path.stem, {"machine": data.get("machine", {}),
                                                          "chapters": {}})
                    entry["chapters"][f"{int(match.group(1)):02d}"] = {"gbps": row["median_gbps"]}
    for setup, entry in setups.items():  # scripts/bench.py: against its baselines file
        _, runs = _runs(results / "baselines" / f"{setup}.json")
        best = max((r for r in runs if r["size"] == page and "both ways" not in r["tool"]),
                   key=lambda r: r["median_gbps"], default=None)  # both ways: 2 GPUs' ceiling
        for figure in entry["chapters"].values():
            figure["limit_gbps"] = best and best["median_gbps"]
            figure["limit"] = best and best["tool"]
            figure["percent"] = best and 100 * figure["gbps"] / best["median_gbps"]
    for path in sorted((results / "progression").glob("*.json")):  # scripts/progression.py
        data, runs = _runs(path)
        if len({row.get("tool") for row in runs if CHAPTER.match(row.get("tool", ""))}) < 2:
            continue  # one chapter alone (the model's measurements of 13) is not a journey
        for row in runs:
            match = CHAPTER.match(row.get("tool", ""))
            if match and "percent_of_ceiling" in row:
                size = f"{row['size'] >> 20} MiB" if row["size"] >= 1 << 20 else \
                    f"{row['size'] >> 10} KiB"
                entry = setups.setdefault(f"{path.stem}, 09-15 at {size}",
                                          {"machine": data.get("machine", {}), "chapters": {}})
                entry["chapters"][f"{int(match.group(1)):02d}"] = {
                    "gbps": row["median_gbps"], "limit": row["ceiling"],
                    "percent": row["percent_of_ceiling"],
                    "limit_gbps": row["median_gbps"] * 100 / row["percent_of_ceiling"]}
    return setups


def blog_percent(blog, chapter):
    """The blog's figure as % of the links it used: one NIC in 07, all of them after."""
    entry = blog["chapters"][chapter]
    return 100 * entry["gbps"] / entry.get("limit_gbps", blog["limit_gbps"])


def _model(ax, rows, x, key, label):
    """The model's points, one marker per role: predicted, fitted."""
    for role, marker in (("predicted", "D"), ("fitted", "s")):
        mine = [c for c in rows if c in x and rows[c]["role"] == role]
        ax.plot([x[c] for c in mine], [rows[c][key] for c in mine], marker, color="tab:red",
                fillstyle="none", markersize=9, linestyle="none", label=f"{label} ({role})")


def plot(blog, calibration, ours, path=None):
    """Two panels: Gbps on the p5 (blog and model), then % of a baseline on each machine."""
    import matplotlib
    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["chapter"]: r for r in calibration["chapters"]}
    chapters = sorted(set(rows) | {c for e in ours.values() for c in e["chapters"]})
    x = {c: i for i, c in enumerate(chapters)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    on_p5 = [c for c in chapters if c in blog["chapters"]]
    top.plot([x[c] for c in on_p5], [blog["chapters"][c]["gbps"] for c in on_p5], "ko-",
             label="blog, p5 (measured)")
    _model(top, rows, x, "model_gbps", "model, p5")
    top.axhline(blog["limit_gbps"], color="grey", linestyle="--",
                label=f"{blog['limit_gbps']} Gbps: 32 NICs x 100 Gbps")
    top.axhline(100, color="grey", linestyle=":", label="100 Gbps: one NIC (chapter 07)")
    top.set_yscale("log")
    top.set_ylabel("Gbps (log scale)")
    top.set_title("The series on an AWS p5, 64 KiB WRITEs: measured by the blog, and the model")
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))

    bottom.plot([x[c] for c in on_p5], [blog_percent(blog, c) for c in on_p5], "ko-",
                label="blog, p5: % of line rate")
    _model(bottom, rows, x, "percent_of_line", "model, p5: % of line rate")
    for (setup, entry), color in zip(sorted(ours.items()), OURS * len(ours)):
        have = [c for c in chapters if c in entry["chapters"] and entry["chapters"][c]["percent"]]
        if any("09-15" in other for other in ours) and "09-15" not in setup:
            have = [c for c in have if c < "09"]  # 09 on: the back-to-back runs say it
        if have:
            base = entry["chapters"][have[0]]["limit"] if "09-15" in setup else "best baseline"
            bottom.plot([x[c] for c in have], [entry["chapters"][c]["percent"] for c in have],
                        "o--", color=color, label=f"ours, {setup}: % of {base}")
    bottom.axhline(100, color="grey", linestyle="--")
    bottom.set_ylabel("% of line rate / of a baseline")
    bottom.set_xticks(range(len(chapters)), chapters)
    bottom.set_xlabel("chapter")
    bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    bottom.set_title("p5: % of line rate. Ours: % of a baseline measured in the same run\n"
                     "(what a tool got there, not a limit; 64 KiB unless the legend says)",
                     fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig

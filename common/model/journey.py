"""The journey, chapter by chapter: the blog's p5 figures, the model's, ours and yours.

Ours are read from results/<NN_name>/<setup>.json (scripts/bench.py), whichever
chapters and setups exist; each at the series' page size, as a share of the
best baseline (fi_rma_bw, UCX, cudaMemcpyPeer) measured in the same setup at
the same size: results/baselines/<setup>.json. And from results/progression/
(scripts/progression.py: chapters 09-15 back to back), at each size there,
as a share of the baseline measured in the same run. Yours are the records a
chapter writes with --json into results/runs/ (common/bench.py: run_path).
A baseline is what a tool got, not a limit: on the 2-core VM (shm, host memory,
64 KiB) chapters 13-15 moved 2.3x what fi_rma_bw -o write moved. (The files keep
their key names, "limit" and "percent_of_ceiling"; the figure calls them baselines.)
"""
import json
import re
from pathlib import Path

from common import palette

PAGE = 64 << 10
CHAPTER = re.compile(r"chapter (\d+)")


def _runs(path):
    try:
        data = json.loads(path.read_text())
        return data, [r for r in data["runs"] if "median_gbps" in r and "size" in r]
    except (OSError, ValueError, KeyError, TypeError):
        return None, []


def where(data):
    """What a figure was measured on: machine, provider, memory and libfabric version."""
    return {key: data.get(key) for key in ("machine", "provider", "memory", "libfabric")}


def measured(results, page=PAGE):
    """{setup: {machine, provider, memory, libfabric, "chapters": {"07": {gbps, limit_gbps,
    limit, percent}}}}: limit is the baseline each figure is a share of."""
    results = Path(results)
    setups = {}
    for folder in sorted(p for p in results.iterdir() if p.is_dir() and re.match(r"\d\d_", p.name)):
        for path in sorted(folder.glob("*.json")):
            data, runs = _runs(path)
            for row in runs:
                match = CHAPTER.match(row.get("tool", ""))
                if match and row["size"] == page:
                    entry = setups.setdefault(path.stem, {**where(data), "chapters": {}})
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
                                          {**where(data), "size": row["size"], "chapters": {}})
                entry["chapters"][f"{int(match.group(1)):02d}"] = {
                    "gbps": row["median_gbps"], "limit": row["ceiling"],
                    "percent": row["percent_of_ceiling"],
                    "limit_gbps": row["median_gbps"] * 100 / row["percent_of_ceiling"]}
    return setups


def yours(results):
    """The reader's own runs: every chapter record in RESULTS/runs/ (a chapter's --json),
    oldest first; none when the folder is absent or empty. Unreadable files are skipped."""
    runs = []
    for path in sorted(Path(results, "runs").glob("*.json")):
        try:
            data = json.loads(path.read_text())
            chapter = re.match(r"(\d\d)_", data["chapter"]).group(1)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        runs.append({**data, "chapter": chapter, "file": path.name})
    return sorted(runs, key=lambda r: str(r.get("date")))


def describe(entry):
    """One line of where: '2-core AMD EPYC, shm, host memory, libfabric 2.1.0'."""
    m = entry.get("machine") or {}
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return (f"{m.get('cores')}-core {m.get('cpu')}{gpu}, {entry.get('provider')}, "
            f"{entry.get('memory')} memory, libfabric {entry.get('libfabric')}")


def blog_percent(blog, chapter):
    """The blog's figure as % of the links it used: one NIC in 07, all of them after."""
    entry = blog["chapters"][chapter]
    return 100 * entry["gbps"] / entry.get("limit_gbps", blog["limit_gbps"])


def _model(ax, rows, x, key, label):
    """The model's points, one marker per role: predicted, fitted."""
    for role, marker in (("predicted", "D"), ("fitted", "s")):
        mine = [c for c in rows if c in x and rows[c]["role"] == role]
        ax.plot([x[c] for c in mine], [rows[c][key] for c in mine], marker, color=palette.MODEL,
                fillstyle="none", markersize=9, linestyle="none", label=f"{label} ({role})")


def at_series_size(ours, page=PAGE):
    """One series per setup of ours at the series' page size: chapter 07 (and what else
    scripts/bench.py measured) joined with the back-to-back run of 09-15 where there is one."""
    series = {}
    for setup, entry in sorted(ours.items()):
        base = setup.split(", 09-15")[0]
        if ", 09-15" in setup and entry.get("size") != page:
            continue
        mine = series.setdefault(base, {**entry, "chapters": {}})
        for chapter, figure in entry["chapters"].items():
            if figure.get("percent") and (", 09-15" in setup or chapter not in mine["chapters"]):
                mine["chapters"][chapter] = figure
    return {setup: entry for setup, entry in series.items() if entry["chapters"]}


def plot(blog, calibration, ours, mine=(), path=None):
    """Two questions, a panel each. Top: how the series climbed on the p5, and how close the
    model comes (Gbps). Bottom: how close each chapter came to the baseline measured beside
    it, on our machines and in your runs (% of that baseline, 64 KiB)."""
    import matplotlib
    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {r["chapter"]: r for r in calibration["chapters"]}
    series = at_series_size(ours)
    mine = [r for r in mine if r.get("percent_of_limit") and r.get("page_size") == PAGE]
    chapters = sorted(set(rows) | {c for e in series.values() for c in e["chapters"]}
                      | {r["chapter"] for r in mine})
    x = {c: i for i, c in enumerate(chapters)}
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 8.5), sharex=True)
    on_p5 = [c for c in chapters if c in blog["chapters"]]
    top.plot([x[c] for c in on_p5], [blog["chapters"][c]["gbps"] for c in on_p5], "o-",
             color=palette.BLOG, label="blog, p5 (measured)")
    _model(top, rows, x, "model_gbps", "model, p5")
    top.axhline(blog["limit_gbps"], color=palette.LINE_RATE, linestyle="--",
                label=f"{blog['limit_gbps']} Gbps: 32 NICs x 100 Gbps")
    top.axhline(100, color=palette.LINE_RATE, linestyle=":", label="100 Gbps: one NIC (chapter 07)")
    top.set_yscale("log")
    top.set_ylabel("Gbps (log scale)")
    top.set_title("On an AWS p5 (8 H100, 32 EFA NICs, libfabric 2.0), 64 KiB WRITEs:\n"
                  "how the series climbed (the blog), and how close the model comes", fontsize=10)
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))

    for (setup, entry), (marker, style) in zip(series.items(), palette.SETUP_STYLES * 4):
        have = sorted(entry["chapters"])
        bottom.plot([x[c] for c in have], [entry["chapters"][c]["percent"] for c in have],
                    marker=marker, linestyle=style, color=palette.OURS,
                    label=f"ours, {setup}:\n{describe(entry)}")
    for where_, runs in grouped(mine).items():
        bottom.plot([x[r["chapter"]] for r in runs], [r["percent_of_limit"] for r in runs], "*",
                    color=palette.YOURS, markersize=12, linestyle="none",
                    label=f"yours (results/runs/):\n{where_}")
    bottom.axhline(100, color=palette.LINE_RATE, linestyle="--")
    bottom.set_ylabel("% of the baseline measured beside it")
    bottom.set_xticks(range(len(chapters)), chapters)
    bottom.set_xlabel("chapter")
    bottom.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), labelspacing=0.9)
    bottom.set_title("On our machines and yours, 64 KiB WRITEs: each chapter as % of the baseline\n"
                     "measured beside it (fi_rma_bw; on GPUs also UCX and cudaMemcpyPeer)",
                     fontsize=10)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def grouped(runs):
    """Runs by where they were measured (describe())."""
    groups = {}
    for run in runs:
        groups.setdefault(describe(run), []).append(run)
    return groups

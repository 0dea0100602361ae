"""Measuring a run: a live progress line, the series' figures, the limit, a JSON record.

Throughput is counted as the series counts it, on the writer, from its own
WRITE completions: Gbps = 8 * bytes / elapsed, Mpps = operations / elapsed.
A figure means little alone, so each run names the limit it is compared to:
the link speed the NIC reports, or else a fabtests baseline whose record says
it was measured on a machine like this one (CPU, cores, GPU), with the same
provider, libfabric version, memory and size (scripts/baseline.py); a record
of anything else is no limit here, so then the run prints the command that
measures one.
"""
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import common.fabric as fi
from common import cli
from common.fabric import lib
from common.records import ROOT, arguments, git_sha, machine, options, write_json  # noqa: F401 (bench.machine, bench.arguments)

RESULTS = ROOT / "results"
BASELINES = RESULTS / "baselines"


def figures(ops, size, elapsed):
    return {"ops": ops, "page_size": size, "bytes": ops * size, "elapsed_s": elapsed,
            "gbps": 8 * ops * size / elapsed / 1e9, "mpps": ops / elapsed / 1e6}


class Progress:
    """One line, rewritten in place on a terminal: operations done so far and the rate."""

    def __init__(self, what, total, size, every=0.5, stream=sys.stderr):
        self.what, self.total, self.size, self.every, self.stream = what, total, size, every, stream
        self.live = stream.isatty()
        self.start = self.last = time.perf_counter()

    def update(self, done):
        now = time.perf_counter()
        if not self.live or now - self.last < self.every:
            return
        self.last = now
        f = figures(done, self.size, now - self.start)
        print(f"\r  {self.what}: {done}/{self.total}  {f['gbps']:.3f} Gbps  "
              f"{f['mpps']:.3f} Mpps  {now - self.start:.1f} s ", end="", file=self.stream,
              flush=True)

    def close(self):
        if self.live:
            print("\r\033[K", end="", file=self.stream, flush=True)


def same_machine(a, b):
    return (a.get("cpu"), a.get("cores"), a.get("gpu")) == (b["cpu"], b["cores"], b.get("gpu"))


def same_libfabric(recorded):
    """Whether a record's libfabric ("2.1.0", as fi_info --version says) is the one this
    process runs (major.minor: what fi_version() tells)."""
    return (recorded or "").split(".")[:2] == [str(n) for n in fi.version()]


def baseline(provider, memory, size, here, tool="fi_rma_bw"):
    """The median Gbps of `tool` (fi_rma_bw by default) recorded for this machine, provider,
    libfabric version, memory and size, and where it is written; or None."""
    for path in sorted(BASELINES.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (data.get("provider"), data.get("memory")) != (provider, memory) \
                or not same_machine(data.get("machine", {}), here) \
                or not same_libfabric(data.get("libfabric")):
            continue
        for row in data.get("runs", []):
            if row["tool"].startswith(tool) and row["size"] == size:
                return row["median_gbps"], f"{tool} here ({path.relative_to(ROOT)})"
    return None


def limit(infos, provider, memory, size, here, tool="fi_rma_bw"):
    """(Gbps, what it is) to measure a run against, or (None, why there is none).
    `infos`: the fi_info of the NIC used, or a list of them (their speeds add up);
    without a link speed, the baseline of `tool` measured here."""
    infos = infos if isinstance(infos, list) else [infos]
    speed = sum(lib.tut_nic_speed(i) for i in infos)
    if speed and len(infos) == 1:
        return speed / 1e9, f"link speed of {fi.string(infos[0].domain_attr.name)}"
    if speed:
        return speed / 1e9, f"link speed of {len(infos)} NICs"
    return baseline(provider, memory, size, here, tool) or (
        None, f"no link speed, and no {tool} baseline of this machine, {provider} and libfabric "
        f"{'%d.%d' % fi.version()}; measure one: {measure_command(tool, provider, memory, size)}")


def tools_prefix():
    """Where the scripts take fabtests from: FABTESTS_PREFIX; else LIBFABRIC_PREFIX where it is
    the libfabric the binding loads (a chapter stops on any other: fabric.prefix_mismatch);
    else what scripts/build_libfabric.sh builds (.deps/libfabric)."""
    lf = os.environ.get("LIBFABRIC_PREFIX")
    return Path(os.environ.get("FABTESTS_PREFIX") or (lf if lf and fi.loads_from(lf) else
                                                     ROOT / ".deps" / "libfabric"))


def measure_command(tool, provider, memory, size):
    """The command that measures the baseline `limit` looks for. Where the scripts find no
    fi_rma_bw (Debian packages no fabtests), it first builds libfabric 2.1.0 with them and
    puts the chapters on it, so that the baseline is of the libfabric the chapters run."""
    script = "baseline.py" if tool == "fi_rma_bw" else "progression.py"
    run = cli.command("-p", provider, "--sizes", size, *(["--gpus", "0,1"] * (memory == "cuda")),
                      program=ROOT / "scripts" / script)
    if memory == "cuda" or (tools_prefix() / "bin" / "fi_rma_bw").exists():
        return run
    built = cli.shown(ROOT / ".deps" / "libfabric")
    return (f"bash {cli.shown(ROOT / 'scripts' / 'build_libfabric.sh')} && LIBFABRIC_PREFIX={built} "
            f"bash {cli.shown(ROOT / 'scripts' / 'setup.sh')} && {run}")


def summary(f, lim):
    """The final line: Gbps, Mpps, elapsed time and % of the limit."""
    gbps, what = lim
    share = f"{100 * f['gbps'] / gbps:.1f}% of {gbps:.3f} Gbps, {what}" if gbps else what
    return (f"{f['ops']} WRITEs of {f['page_size']} bytes in {f['elapsed_s']:.3f} s: "
            f"{f['gbps']:.3f} Gbps, {f['mpps']:.3f} Mpps ({share})")


def run_path(path, *name):
    """Where `--json` writes: the file given, or for a bare `--json`
    results/runs/<name parts>-<time>.json."""
    if path != "auto":
        return path
    return RESULTS / "runs" / ("-".join(map(str, name)) + time.strftime("-%Y%m%dT%H%M%S.json"))


def record(path, chapter, args, info, memory, here, f, lim, client_args, lesson):
    """Write one run as JSON: chapter, the server's flags (`args`, this process's) and the
    client's (`client_args`: what its CONNECT carried), provider, libfabric, machine, git sha,
    figures; `lesson` names the figure's field that shows the chapter's lesson (its LESSON's
    "field"), which `f` must hold."""
    if f.get(lesson) is None:
        raise ValueError(f"{chapter}: no lesson figure '{lesson}' in the record")
    gbps, what = lim
    data = {"chapter": chapter, "server_args": options(args), "client_args": client_args,
            "lesson": lesson, "provider": fi.provider_of(info),
            "memory": memory, "libfabric": "%d.%d" % fi.version(), "machine": here,
            "git": git_sha(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **f, "limit_gbps": gbps, "limit": what,
            "percent_of_limit": 100 * f["gbps"] / gbps if gbps else None}
    return write_json(path, data)


def median(values):
    return statistics.median(values) if values else None

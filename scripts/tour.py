"""The tour: every chapter on this machine, each where its lesson shows, and whether it did.

    .venv/bin/python scripts/tour.py              # each chapter on its provider (below)
    .venv/bin/python scripts/tour.py -p tcp       # every chapter on tcp

Each chapter declares, in the LESSON dict below its docstring, what shows its lesson:
  "figure"    what to read: "check" (its run checks its data: that is the lesson), or a
              figure of FIGURES below, printed by its server
  "visible"   when that figure counts as shown: a threshold every repeat meets
              ({"at_least": 1}), or a factor by which it beats another chapter (or itself
              with other server flags) on medians, each median outside the range of the
              other's repeats ({"than": "11 --engine python", "by": 1.5})
  "client"    the client's flags of the run that shows it (the server prints that command)
  "field"     where its --json record keeps that figure (chapters that write one)
  "why_not"   per provider, why the figure cannot move there on a machine like this one:
              a reason for every libfabric, or reasons per major version where the
              provider differs between them ({"2": "..."}: on 2.x; on 1.x it can move)
The tour runs each chapter on this host's default provider (what the chapters pick),
unless its "why_not" gives a reason for that one on this libfabric: then on the first
other provider usable here that it gives none for (tcp beside shm on a host without a
NIC); -p runs them all on one. Server and client run as a pair on this host; every byte
is verified. The table says per chapter what it showed, where it ran and why, and whether
the lesson is visible; where it is not, the chapter's "why_not" for the provider it ran on
(that one's only) says why. Measured figures come from --repeats runs, chapter after
chapter within a repeat, so that a busy moment hits them all; a chapter and the one it is
compared with run on the same provider.
"""
import ast
import platform
import re
import shlex
import statistics
import sys
import time

from common import usage
from common.chapter_pair import ROOT, chapter_path, run_one, run_pair

MESSAGE = "Hello from the tour"
PREFERENCE = ("efa", "verbs", "shm", "tcp")  # as the chapters pick (fi.DEFAULT_PROVIDERS)
# figure: (pattern in the server's output, format of a value, its unit, whether lower is better)
FIGURES = {
    "refused": (r"-FI_EAGAIN (\d+) times", "{:.0f}", "refused posts", True),
    "CPU per WRITE": (r"CPU time: ([\d.]+) us per WRITE", "{:.2f}", "us CPU per WRITE", True),
    "first WRITE": (r"first contact vs a warm WRITE: .*\((\d+)x\)", "{:.0f}x",
                    "first WRITE / a warm one", False),
}


def base(provider):
    """A provider's own name: "tcp" of "tcp;ofi_rxm"."""
    return provider.split(";")[0]


def reason(lesson, provider, version):
    """The chapter's word on why its figure cannot move on `provider` with libfabric
    `version` (major, minor), or None where it can: a reason given as text holds on every
    version, one given per major version ({"2": ...}) on the versions it names."""
    said = lesson.get("why_not", {}).get(base(provider))
    return said.get(str(version[0])) if isinstance(said, dict) else said


def provider_for(lesson, forced, default, usable, version):
    """(provider, why) a chapter runs on: -p's for every chapter; else this host's default,
    unless the chapter's "why_not" gives a reason for it on libfabric `version`: then the
    first provider usable here, in the chapters' order of preference (common/fabric:
    DEFAULT_PROVIDERS), that it gives none for; where it rules them all out, the default
    after all."""
    if forced:
        return forced, "-p"
    ruled_out = {name for name in lesson.get("why_not", {}) if reason(lesson, name, version)}
    if base(default) not in ruled_out:
        return default, "the default"
    here = {base(p): p for p in usable}
    for name in PREFERENCE:
        if name in here and name not in ruled_out:
            return name, f"its lesson cannot move on {base(default)}"
    return default, "the default; its lesson moves on no provider here"


def why_not(stem, lesson, provider, version):
    """Why a chapter's lesson did not show on the provider it ran on, as the tour prints
    it: the chapter's word for that provider on this libfabric (its only), or that it has
    none."""
    said = reason(lesson, provider, version)
    return (f"{stem} on {base(provider)}: "
            + (said or f"not beyond the noise in these repeats, though its LESSON gives "
               f"no reason it cannot show on {base(provider)} (run the tour again)"))


def lesson(path):
    """The chapter's LESSON, read without running the chapter: a ValueError naming the
    chapter where it has none, or one the tour cannot judge."""
    found = [node.value for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "LESSON"]
    if not found:
        raise ValueError(f"{path.name}: no LESSON (the figure that shows its lesson)")
    try:
        declared = ast.literal_eval(found[-1])
    except ValueError:
        raise ValueError(f"{path.name}: LESSON is not a literal") from None
    wrong = malformed(int(path.name[:2]), declared)
    if wrong:
        raise ValueError(f"{path.name}: LESSON {wrong}")
    return declared


def malformed(number, declared):
    """What the tour cannot judge in chapter `number`'s LESSON, or None. A chapter the tour
    checks (CHECKS) has figure 'check', or the rule its check holds; one it measures names
    a figure of FIGURES, the client run that shows it and one rule of what is visible."""
    if not isinstance(declared, dict) or not isinstance(declared.get("figure"), str):
        return "is not a dict with a 'figure'"
    reasons = declared.get("why_not", {})
    if not isinstance(reasons, dict):
        return "'why_not' needs a dict of reasons by provider"
    for provider, said in reasons.items():
        if not (isinstance(said, str) and said or isinstance(said, dict) and said and all(
                str(major).isdigit() and isinstance(text, str) and text
                for major, text in said.items())):
            return (f"'why_not' of {provider} needs a reason, or one per libfabric major "
                    "version ({'2': ...})")
    rule = declared.get("visible")
    if number in CHECKS and "visible" not in declared:
        return None if declared["figure"] == "check" else \
            "of a chapter the tour checks needs figure 'check', or a 'visible' rule"
    if number not in CHECKS and declared["figure"] not in FIGURES:
        return f"figure {declared['figure']!r} is none the tour measures ({', '.join(FIGURES)})"
    if number not in CHECKS and not str(declared.get("client", "")).strip():
        return "needs the 'client' flags of the run that shows it"
    if not isinstance(rule, dict) or len({"at_least", "at_most", "than"} & set(rule)) != 1:
        return "needs one 'visible' rule: at_least, at_most or than"
    if "than" in rule:
        other = str(rule["than"]).split()[:1]
        if not (other and other[0].isdigit() and int(other[0]) <= number):
            return f"'than' names no chapter up to {number:02d}: {rule['than']!r}"
        if not isinstance(rule.get("by"), (int, float)) or rule["by"] <= 1:
            return "'than' needs a factor 'by' above 1"
    elif not isinstance(rule.get("at_least", rule.get("at_most")), (int, float)):
        return "'at_least' or 'at_most' needs a number"
    return None


def alone(chapter, provider, pattern, say):
    """Run a chapter that needs no peer; `say(match)` words the result."""
    args = [sys.executable, str(chapter_path(chapter))] + (["-p", provider] if provider else [])
    done = run_one(args, 60)
    m = re.search(pattern, done.stdout)
    if done.returncode or not m:
        return False, last_line(done.stderr or done.stdout)
    return True, say(m)


def ch03(provider, _):
    return alone(3, provider, r"\d+ providers?, \d+ \(provider, domain\) pairs?",
                 lambda m: m[0])  # "1 provider, 1 (provider, domain) pair" on -p shm


def ch04(provider, _):
    pair = run_pair(4, provider, client_args=[[MESSAGE]])
    ok = pair.ok and f"received {len(MESSAGE)} bytes: {MESSAGE}" in pair.server.out
    return ok, f"server received '{MESSAGE}'" if ok else failure(pair)


def ch05(provider, _):
    texts = ["first client", "second client"]
    pair = run_pair(5, provider, ["--clients", str(len(texts))], [[t] for t in texts])
    ok = pair.ok and all(f"got back {t[::-1]!r}" in c.out for t, c in zip(texts, pair.clients))
    return ok, f"{len(texts)} clients served, replies reversed" if ok else failure(pair)


def ch06(provider, _):
    pair = run_pair(6, provider, ["--clients", "1"], [["--pages", "0-15", "--page-size", "64K"]])
    ok = pair.ok and "verified 16 pages (1048576 bytes): 0 wrong bytes" in pair.clients[0].out
    return ok, "16 x 64 KiB written, immediate seen, 0 wrong bytes" if ok else failure(pair)


def ch08(provider, _):
    return alone(8, provider, r"GPUs: (\d+).*NICs: (\d+).*physical cores: (\d+)",
                 lambda m: f"{m[1]} GPUs, {m[2]} NICs, {m[3]} physical cores")


def ch09(provider, lesson):
    pair = run_pair(9, provider, ["--clients", "1"], [shlex.split(lesson["client"])])
    per_nic = re.search(r"WRITEs per NIC: ([\d ]+),", pair.server.out)
    ok = pair.ok and per_nic and "0 wrong bytes" in pair.clients[0].out
    counts = per_nic[1].split() if per_nic else []
    ok = ok and f"immediate data from {len(counts)} NICs" in pair.clients[0].out
    return ok, f"WRITEs per NIC: {' '.join(counts)}, 0 wrong bytes" if ok else failure(pair)


def ch16(provider, _):
    """4 ranks as 2 emulated nodes: every check, then a short benchmark."""
    done = run_one(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "-n", "4", "--ranks-per-node", "2",
         str(chapter_path(16)), *(["-p", provider] if provider else []), "--max-tokens", "16",
         "--hidden", "256", "--experts", "16", "--topk", "4", "--iters", "5"], 300)
    checks = len(re.findall(r"^\[0\] check .* on 4 of 4 ranks", done.stdout, re.MULTILINE))
    if done.returncode or "all checks passed" not in done.stdout:
        return False, last_line(done.stderr or done.stdout)
    return True, f"{checks} checks exact on 4 ranks / 2 nodes"


def ch17(provider, _):
    """One rank on GPU 0: every check, and one layer in a CUDA graph replayed 100 times;
    None (not run) where there is no GPU with cupy."""
    from common.gpu_ready import why_not
    reason = why_not()
    if reason is not None:
        return None, f"not run here: it {reason}"
    done = run_one(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "-n", "1", "--gpus", "0",
         str(chapter_path(17)), *(["-p", provider] if provider else []), "--max-tokens", "16",
         "--hidden", "256", "--experts", "16", "--topk", "4", "--counts", "device", "--graph",
         "--iters", "0"], 300)
    if done.returncode or "all checks passed" not in done.stdout:
        return False, last_line(done.stderr or done.stdout)
    return True, "checks exact on the GPU, and 100 replays of a CUDA graph"


def ch18(provider, _):
    """A small prompt's KV cache from a prefiller to a decoder, every byte checked."""
    small = ["--tokens", "512", "--layers", "8"]
    pair = run_pair(18, provider, small, [small])
    found = re.search(r"^checked (\d+) pages and the context: 0 wrong bytes$", pair.server.out,
                      re.MULTILINE)
    if not (pair.ok and found):
        return False, failure(pair)
    return True, f"{found[1]} KV pages and the context, 0 wrong bytes"


def ch19(provider, _):
    """3 trainers (shards whose edges split fp8 blocks) update 1 inference rank twice."""
    done = run_one(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "-n", "4",
         str(chapter_path(19)), *(["-p", provider] if provider else []), "--model", "tiny",
         "--trainers", "3"], 300)
    exact = re.findall(r"^\[0\] (?:update \d|naive).*: 0 wrong bytes; (\d+) tensors changed "
                       r"\((\d+) expected\)$", done.stdout, re.MULTILINE)
    if done.returncode or "all checks passed" not in done.stdout or len(exact) != 3:
        return False, last_line(done.stderr or done.stdout)
    return True, (f"2 updates and the naive way, every fp8 weight and scale exact; "
                  f"{exact[1][0]} tensors changed in the second, as expected")


CHECKS = {3: ch03, 4: ch04, 5: ch05, 6: ch06, 8: ch08, 9: ch09, 16: ch16, 17: ch17, 18: ch18,
          19: ch19}


def last_line(text):
    return (text.strip().splitlines() or ["no output"])[-1]


def failure(pair):
    for run in [*pair.clients, pair.server]:
        if run.rc:
            return last_line(run.err or run.out)
    return "unexpected output"


class Runs:
    """Measured runs, each (chapter, server flags, client flags, provider) once per repeat:
    the figure of each, or the one line saying why a run failed."""

    def __init__(self):
        self.values, self.failed = {}, {}

    def measure(self, spec):
        chapter, server, client, provider = spec
        pair = run_pair(chapter, provider, ["--clients", "1", *server], [list(client)],
                        timeout=120)
        if not (pair.ok and "): 0 wrong bytes" in pair.clients[0].out):
            self.failed[spec] = failure(pair)
        for figure, (pattern, *_) in FIGURES.items():
            if found := re.search(pattern, pair.server.out):
                self.values.setdefault((spec, figure), []).append(float(found[1]))

    def of(self, spec, figure):
        """The values of `figure` over the repeats; a run that did not print it fails."""
        if spec in self.failed or (spec, figure) not in self.values:
            return None, self.failed.get(spec, f"chapter {spec[0]:02d} printed no {figure}")
        return self.values[(spec, figure)], None


def specs(number, lesson, provider):
    """The runs a measured chapter needs: its own, and the one it is compared with, both
    on `provider`."""
    client = tuple(shlex.split(lesson["client"]))
    mine = (number, (), client, provider)
    than = lesson["visible"].get("than")
    if not than:
        return mine, None
    other, *server = shlex.split(than)
    return mine, (int(other), tuple(server), client, provider)


def spread(values, form):
    """The median and the range of the repeats."""
    low, middle, high = (form.format(v) for v in (min(values), statistics.median(values),
                                                  max(values)))
    return f"{middle} ({low}-{high})"


def verdict(lesson, mine, theirs):
    """(visible, why) for a measured chapter: its values against its rule."""
    rule, lower = lesson["visible"], FIGURES[lesson["figure"]][-1]
    if "at_least" in rule:
        return min(mine) >= rule["at_least"], f"every repeat >= {rule['at_least']:g}"
    if "at_most" in rule:
        return max(mine) <= rule["at_most"], f"every repeat <= {rule['at_most']:g}"
    a, b = statistics.median(mine), statistics.median(theirs)
    better, worse = (b, a) if lower else (a, b)
    factor = better / worse if worse else float("inf") if better else 1.0  # 0 against 0: even
    # Beyond the noise: each median outside the other's whole range, so that one repeat
    # that a burst of load slowed (or sped) cannot make the lesson, nor hide it.
    apart = (a < min(theirs) and b > max(mine)) if lower else (a > max(theirs) and b < min(mine))
    word = "lower" if lower else "higher"
    form = FIGURES[lesson["figure"]][1]
    by = (f"{factor:.1f}x {word}" if factor < float("inf")  # none against some: no factor
          else f"{word}: {form.format(a)} against {form.format(b)}")
    if factor >= rule["by"] and apart:
        return True, f"{by}, each median beyond the other's range"
    return False, (f"{factor:.2f}x {word}, less than {rule['by']:g}x" if factor < rule["by"]
                   else f"{by}, but a median lies in the other's range")


def about_here(provider):
    """(the provider -p or the default gives, every provider usable here, libfabric's
    version (major, minor), a line saying them and the machine), as the chapters see them;
    exits on a bad -p."""
    code = ("import sys, common.fabric as fi\n"
            "from common.engine.multinet import CAPS\n"
            "from common.records import machine\n"
            f"try: info, why = fi.pick({provider!r}, CAPS)\n"
            "except ValueError as e: sys.exit(str(e))\n"
            "m = machine()\n"
            "print(fi.provider_of(info)); print(' '.join(fi.usable(CAPS)))\n"
            "print('%d %d' % fi.version())\n"
            "print(f\"provider {fi.provider_of(info)} ({why}), libfabric %d.%d, "
            "{m['cpu']} x {m['cores']} cores\" % fi.version())")
    done = run_one([sys.executable, "-c", code], 60)
    if done.returncode:
        sys.exit(f"tour: {last_line(done.stderr or done.stdout)}")
    chosen, usable, version, line = done.stdout.strip().splitlines()
    return (chosen, usable.split(), tuple(map(int, version.split())),
            f"{line}, {platform.machine()}")


def main():
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("-p", "--provider", help="run every chapter on this provider")
    p.add_argument("--repeats", type=int, default=3, choices=range(3, 21), metavar="3..20",
                   help="runs of each measured chapter (default 3)")
    args = p.parse_args()
    import common.fabric as fi  # the binding: loaded only once the flags are good
    if why := fi.prefix_mismatch():  # every chapter would stop on it: say it once
        p.error(why)
    start = time.monotonic()
    default, usable, version, line = about_here(args.provider)
    print(f"{line}\n")
    chapters = {int(path.name[:2]): path
                for path in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py"))}
    try:
        lessons = {n: lesson(path) for n, path in chapters.items()}
    except ValueError as e:  # a chapter the tour cannot judge: said before anything runs
        sys.exit(f"tour: {e}")
    where = {n: provider_for(lessons[n], args.provider, default, usable, version)
             for n in chapters}
    # what each chapter is given: -p, or another provider than the default; else nothing,
    # so that it picks the default itself (03 then lists every provider, not one)
    given = {n: p if args.provider or p != default else None for n, (p, _) in where.items()}
    rows, notes = {}, []
    for n, path in chapters.items():
        if n in CHECKS:
            ok, said = CHECKS[n](given[n], lessons[n])
            if ok is None:  # it cannot run on this machine: said, not counted
                notes.append(f"{path.stem}: {said}")
                continue
            rows[n] = (said, "yes" if ok else "no", ok)
            print(f"  {path.stem}: {'ok' if ok else 'FAILED'}", flush=True)
    measured = {n: specs(n, lessons[n], given[n]) for n in chapters if n not in CHECKS}
    runs = Runs()
    for repeat in range(args.repeats):
        for spec in dict.fromkeys(s for pair in measured.values() for s in pair if s):
            if spec not in runs.failed:
                runs.measure(spec)
        print(f"  repeat {repeat + 1} of {args.repeats}: chapters "
              f"{', '.join(f'{n:02d}' for n in measured)}", flush=True)
    for n, (mine, other) in measured.items():
        lesson_n, figure = lessons[n], lessons[n]["figure"]
        values, failed = runs.of(mine, figure)
        theirs, failed_too = runs.of(other, figure) if other else (None, None)
        if failed or failed_too:
            rows[n] = (failed or failed_too, "-", False)
            continue
        _, form, unit, _ = FIGURES[figure]
        said = f"{spread(values, form)} {unit}"
        if other:
            said += f" vs {spread(theirs, form)} for {' '.join([f'{other[0]:02d}', *other[1]])}"
        visible, why = verdict(lesson_n, values, theirs)
        rows[n] = (said, f"{'yes' if visible else 'no'}: {why}", True)
        if not visible:
            notes.append(why_not(chapters[n].stem, lesson_n, where[n][0], version))
    table = [("chapter", "ran on", "what it shows here", "lesson visible here")] + \
        [(chapters[n].stem, "{} ({})".format(*where[n]), *rows[n][:2]) for n in sorted(rows)]
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    print()
    for row in table:
        print("  ".join(f"{cell:<{width}}" for cell, width in zip(row, widths + [0])).rstrip())
    runs_of = {}  # each measured run, and the chapters that made it: what the figures are of
    for n in measured:
        runs_of.setdefault(lessons[n]["client"], []).append(f"{n:02d} on {where[n][0]}")
    print(f"\nmedians (ranges) of {args.repeats} repeats of these client runs:\n" + "\n".join(
        f"  {', '.join(numbers)}: {flags}" for flags, numbers in runs_of.items()))
    if notes:
        print("\nwhy not here:\n" + "\n".join(f"  {note}" for note in notes))
    failed = [chapters[n].stem for n in sorted(rows) if not rows[n][2]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} chapters ran and verified their data"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + f"; the tour took {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    usage.run(main)  # Ctrl-C: what runs is stopped, one line, exit 130

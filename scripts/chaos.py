"""Fault injection: a signal, a stop, or a peer that leaves, in the middle of real runs, and
the bounds checked.

A trial runs one chapter on shm or tcp, as a server and a client (04-07, 09-15, 18) or as
ranks under scripts/launch.py (16, 19), each started in a process group of its own with
the trial's token in its environment. At an instant drawn over the victim's whole life
(as long as a clean run of the chapter lasts), one process (the victim) gets one fault
(common/chaos/faults.py): SIGINT, SIGTERM, SIGKILL, SIGSTOP (a frozen peer, kept
stopped), STOPCONT or TSTP (stopped, by SIGSTOP or Ctrl-Z's SIGTSTP, and continued after
a pause), EXIT (the client or the ranks end on their own, given a --timeout of 0 up to
half a second), or LIE (the client is scripts/fuzz_connect.py, sending one lie in the
chapter's formats). Then it checks that

- the signalled process ends within 2 s with exit 130 (SIGINT) or 143 (SIGTERM) and one
  line on stderr, no traceback; a continued one ends with one line and a non-zero exit,
  or finishes with no wrong byte;
- every other process ends within its --timeout + 5 s, with one line on stderr when it
  failed, no traceback and no wrong bytes claimed; a server that serves more clients
  serves a second one instead, which must succeed; every rank and the launcher end;
- no process carrying the token is left, nor a /dev/shm file of the trial's processes.

With --trials at least the number of chapter x fault x provider cells, the trials are
stratified: every cell once before any twice (common/chaos/trials.py); the report says
faults survived N/N per cell. A fault that comes while Python itself still starts (before
the program's first import of ours takes the signals: python_starting) ends the victim
Python's way; such a trial counts only if a survivor failed.

Every wait is stretched by the machine's load, as the chapters' own are (common/patience).
What is left after a failed trial is killed and removed, so that the next starts clean.
Trial K of a --seed is always the same trial: `--only K` with the same flags reruns it.

    .venv/bin/python scripts/chaos.py --trials 196 --minutes 40 --seed 1
    .venv/bin/python scripts/chaos.py --chapters 07,15 --providers shm --faults SIGKILL,TSTP \\
        --victims client --seed 3 --only 5
"""
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone

from common import records, usage
from common.chapter_pair import ROOT
from common.chaos.faults import FAULTS
from common.chaos.trials import LIVES, PROVIDERS, SPECS, VICTIMS, cells, choose, run_trial


# --- the report -------------------------------------------------------------------------

def short(fault):
    return fault[3:] if fault.startswith("SIG") else fault


def per_cell(trials):
    """(chapter, fault, provider) -> [survived, counted, missed]."""
    counts = {}
    for t in trials:
        c = counts.setdefault(t.cell, [0, 0, 0])
        c[0] += t.survived
        c[1] += bool(t.counted)
        c[2] += not t.counted
    return counts


def table(trials, faults, providers):
    """Survived/total per chapter (rows) x fault and provider (columns); misses not counted."""
    columns = [(f, p) for f in faults for p in providers]
    head = ["ch"] + [f"{short(f)}/{p}" for f, p in columns]
    counts, rows = per_cell(trials), []
    for chapter in sorted({t.chapter for t in trials}):
        row = [chapter]
        for f, p in columns:
            n = counts.get((chapter, f, p))
            row.append(f"{n[0]}/{n[1]}" if n and n[1] else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head] + rows)


def failed_cells(trials):
    """The cells where a fault was not survived, with their count and the trials' numbers."""
    counts = per_cell(trials)
    return [f"{c} {f} {p}: {counts[(c, f, p)][0]}/{counts[(c, f, p)][1]} (trials "
            + ", ".join(str(t.number) for t in trials if t.cell == (c, f, p) and t.problems)
            + ")" for c, f, p in sorted(counts) if counts[(c, f, p)][0] < counts[(c, f, p)][1]]


def figure(trials):
    counted = [t for t in trials if t.counted]
    return f"faults survived {sum(t.survived for t in counted)}/{len(counted)}"


def describe(trial, rerun):
    lines = [f"trial {trial.number}: chapter {trial.chapter} {trial.provider}, {trial.fault} "
             f"to the {trial.victim} {when(trial)} ({trial.seconds:.1f} s); rerun: "
             f"{rerun} --only {trial.number}"]
    lines += [f"  $ {shlex.join(shown(c))}" for c in trial.commands]
    lines += [f"  {p}" for p in trial.problems]
    return "\n".join(lines)


def when(trial):
    """The instant of the trial's fault in its victim's life, and what the fault drew."""
    at = "" if FAULTS[trial.fault].own_end else \
        f"at {trial.moment:.2f} s of {trial.life:.2f}"
    return ", ".join(w for w in (at, trial.detail) if w)


def shown(args):
    """A command as run from the project's folder."""
    return [".venv/bin/python" if a == sys.executable else
            os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a for a in args]


def libfabric_version():
    """The libfabric the chapters run, asked of a child (libfabric stays out of this
    process, whose Ctrl-C must stay its own)."""
    done = subprocess.run([sys.executable, "-c", "import common.fabric as fi; "
                           "print('%d.%d' % fi.version())"], capture_output=True, text=True,
                          cwd=ROOT)
    return done.stdout.strip() or None


def verdict(trial):
    return "missed (the victim had ended)" if trial.missed else \
        "survived" if trial.survived else "FAILED" if trial.counted else \
        "missed (the victim was still in Python's own start)"


def summary(trials):
    missed = sum(t.missed for t in trials)
    starting = sum(not t.missed and not t.counted for t in trials)
    mean = sum(t.seconds for t in trials) / len(trials) if trials else 0.0
    return figure(trials) + "".join(
        f" ({n} missed: {why})" for n, why in (
            (missed, "the victim had ended before its fault"),
            (starting, "the victim was still in Python's own start")) if n) + \
        f"; {mean:.1f} s a trial"


def record(args, argv, trials, stratified):
    return {"kind": "chaos", "command": "python " + shlex.join(["scripts/chaos.py",
                                                                *records.arguments(argv)]),
            "machine": records.machine(), "libfabric": libfabric_version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git": records.git_sha(), "seed": args.seed, "figure": figure(trials),
            "stratified": stratified,
            "mean_trial_s": round(sum(t.seconds for t in trials) / max(1, len(trials)), 2),
            "lives_s": {f"{c} {p}": round(v[0], 2) if v[0] else None
                        for (c, p), v in sorted(LIVES.items())},
            "cells": {" ".join(k): dict(zip(("survived", "counted", "missed"), v))
                      for k, v in sorted(per_cell(trials).items())},
            "trials": [t.record() for t in trials]}


# --- the command line ------------------------------------------------------------------


def parser():
    p = usage.Parser(prog="chaos.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=usage.positive(int), default=20, help="how many trials")
    p.add_argument("--minutes", type=usage.positive(float), default=10.0,
                   help="start no trial after this many minutes")
    p.add_argument("--seed", type=int, default=0, help="the seed the trials are chosen from")
    p.add_argument("--only", type=usage.positive(int), metavar="K", help="run trial K alone")
    p.add_argument("--chapters", type=usage.listed(tuple(SPECS)), default=list(SPECS))
    p.add_argument("--providers", type=usage.listed(PROVIDERS), default=list(PROVIDERS))
    p.add_argument("--faults", type=usage.listed(tuple(FAULTS), upper=True),
                   default=list(FAULTS))
    p.add_argument("--victims", type=usage.listed(VICTIMS), default=list(VICTIMS))
    p.add_argument("--draw", choices=("cells", "random"),
                   help="cells: every chapter x fault x provider once before any twice "
                   "(the default when --trials covers them all); random: each trial drawn")
    p.add_argument("--json", type=records.parse_label, metavar="LABEL",
                   help="write the trials to results/chaos/LABEL.json")
    return p


def check(p, args):
    if not cells(args.chapters, args.faults, args.providers, args.victims):
        p.error(f"no chapter of {','.join(args.chapters)} has a {','.join(args.victims)} "
                f"for {','.join(args.faults)}")


def main(argv=None):
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    check(p, args)
    every = cells(args.chapters, args.faults, args.providers, args.victims)
    stratified = args.draw == "cells" if args.draw else args.trials >= len(every)
    rerun = shlex.join(["scripts/chaos.py"] + drop_only(argv))
    numbers = [args.only] if args.only else range(1, args.trials + 1)
    deadline, trials = time.monotonic() + 60 * args.minutes, []
    for number in numbers:
        if time.monotonic() > deadline:
            print(f"chaos: {args.minutes:g} minutes are up; {len(trials)} trials run")
            break
        trial = run_trial(choose(number, args.seed, args.chapters, args.providers,
                                 args.faults, args.victims, stratified))
        trials.append(trial)
        print(f"trial {number}: {trial.chapter} {trial.provider} {trial.fault} -> "
              f"{trial.victim} {when(trial)}: {verdict(trial)} ({trial.seconds:.1f} s)",
              flush=True)
    failed = [t for t in trials if t.problems]
    for trial in failed:
        print("\n" + describe(trial, rerun))
    print("\n" + table(trials, args.faults, args.providers))
    covered = len({t.cell for t in trials})
    print(f"\ncells: {covered} of {len(every)} covered"
          + "".join(f"\nFAILED {line}" for line in failed_cells(trials)))
    print(summary(trials))
    if args.json:
        out = records.write_json(ROOT / "results" / "chaos" / f"{args.json}.json",
                                 record(args, argv, trials, stratified))
        print(f"wrote {out.relative_to(ROOT)}")
    return 1 if failed else 0


def drop_only(argv):
    """The command line without its --only K, to which a failure's number is added."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--only":
            skip = True
        elif not a.startswith("--only="):
            out.append(a)
    return out


class Terminated(Exception):
    pass


def terminated(_signum, _frame):
    raise Terminated


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even where started ignoring it
    try:
        sys.exit(main())
    except (KeyboardInterrupt, Terminated) as e:  # the trial's processes were killed on the way
        print(f"chaos: {'terminated' if isinstance(e, Terminated) else 'interrupted'}; "
              "the trial's processes are killed", file=sys.stderr)
        sys.exit(143 if isinstance(e, Terminated) else 130)

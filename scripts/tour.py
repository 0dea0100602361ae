"""The tour: run every chapter on this host's default provider and print a table.

    .venv/bin/python scripts/tour.py              # the default provider (what the chapters pick)
    .venv/bin/python scripts/tour.py -p tcp       # another one

Each step runs a chapter the way its docstring says (server and client as a
pair on this host) and checks what it printed, not just its exit code.
"""
import argparse
import ast
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pair import ROOT, chapter_path, local_env, run_pair  # noqa: E402

MESSAGE = "Hello from the tour"


def alone(chapter, provider, pattern, say):
    """Run a chapter that needs no peer; `say(match)` words the result."""
    args = [sys.executable, str(chapter_path(chapter))] + (["-p", provider] if provider else [])
    done = subprocess.run(args, capture_output=True, text=True, env=local_env(), timeout=60)
    m = re.search(pattern, done.stdout)
    if done.returncode or not m:
        return False, (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return True, [say(m)]


def ch03(provider):
    return alone(3, provider, r"(\d+) providers, (\d+) \(provider, domain\) pairs",
                 lambda m: f"{m[1]} providers, {m[2]} (provider, domain) pairs")


def ch04(provider):
    pair = run_pair(4, provider, client_args=[[MESSAGE]])
    ok = pair.ok and f"received {len(MESSAGE)} bytes: {MESSAGE}" in pair.server.out
    return ok, [f"server received '{MESSAGE}'" if ok else _failure(pair)]


def ch05(provider):
    texts = ["first client", "second client"]
    pair = run_pair(5, provider, ["--clients", str(len(texts))], [[t] for t in texts])
    ok = pair.ok and all(f"got back {t[::-1]!r}" in c.out for t, c in zip(texts, pair.clients))
    return ok, [f"{len(texts)} clients served, replies reversed" if ok else _failure(pair)]


def ch06(provider):
    pair = run_pair(6, provider, ["--clients", "1"], [["--pages", "0-15", "--page-size", "64K"]])
    ok = pair.ok and "verified 16 pages (1048576 bytes): 0 wrong bytes" in pair.clients[0].out
    return ok, ["16 x 64 KiB written, immediate seen, 0 wrong bytes" if ok else _failure(pair)]


def ch07(provider):
    pair = run_pair(7, provider, ["--clients", "1"],
                    [["--iters", "20000", "--buffer-size", "4M", "--pages", "0-63"]])
    speed = re.search(r"in ([\d.]+) s: ([\d.]+) Gbps", pair.server.out)
    ok = (pair.ok and speed is not None
          and "verified 64 pages (4194304 bytes): 0 wrong bytes" in pair.clients[0].out)
    return ok, [f"20000 x 64 KiB WRITEs: {speed[2]} Gbps, 0 wrong bytes" if ok else _failure(pair)]


def ch08(provider):
    return alone(8, provider, r"GPUs: (\d+).*NICs: (\d+).*physical cores: (\d+)",
                 lambda m: f"{m[1]} GPUs, {m[2]} NICs, {m[3]} physical cores")


def multinet(chapter, provider):
    groups = 2 if chapter >= 11 else 1  # from 11 on, a worker thread per group (GPU)
    pair = run_pair(chapter, provider, ["--clients", "1"],
                    [["--groups", str(groups), "--nics-per-gpu", str(4 // groups),
                      "--iters", "20000", "--buffer-size", "4M", "--pages", "0-63"]])
    speed = re.search(r"in ([\d.]+) s: ([\d.]+) Gbps", pair.server.out)
    first = re.search(r"first contact vs steady state: ([\d.]+) ms vs ([\d.]+) us", pair.server.out)
    ok = (pair.ok and speed is not None and "immediate data from 4 NICs" in pair.clients[0].out
          and f"verified {groups} x 64 pages ({groups * 4194304} bytes): 0 wrong bytes"
          in pair.clients[0].out and (chapter == 9 or first is not None))
    if not ok:
        return False, [_failure(pair)]
    extra = f", first WRITE {first[1]} ms vs {first[2]} us" if first else ""
    return True, [f"{groups} x {4 // groups} NICs x 5000 WRITEs: {speed[2]} Gbps{extra}"]


def ch16(provider):
    """4 ranks as 2 emulated nodes: every check, then a short benchmark."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "launch.py"), "-n", "4", "--ranks-per-node", "2",
         str(chapter_path(16)), *(["-p", provider] if provider else []), "--max-tokens", "16",
         "--hidden", "256", "--experts", "16", "--topk", "4", "--iters", "5"],
        capture_output=True, text=True, env=local_env(), cwd=ROOT, timeout=300)
    checks = len(re.findall(r"^\[0\] check .* on 4 of 4 ranks", done.stdout, re.MULTILINE))
    latency = re.search(r"^\[0\]   dispatch +p50 +([\d.]+) us", done.stdout, re.MULTILINE)
    if done.returncode or "all checks passed" not in done.stdout or not latency:
        return False, ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1:]
    return True, [f"{checks} checks exact on 4 ranks / 2 nodes; dispatch p50 {latency[1]} us"]


def _failure(pair):
    for run in [*pair.clients, pair.server]:
        if run.rc:
            return (run.err or run.out).strip().splitlines()[-1]
    return "unexpected output"


STEPS = {3: ch03, 4: ch04, 5: ch05, 6: ch06, 7: ch07, 8: ch08,
         **{n: partial(multinet, n) for n in range(9, 16)}, 16: ch16}


def title(path):
    """'what it shows': the part of the docstring's first line after the dash."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.splitlines()[0].split(": ", 1)[-1].rstrip(".") if doc else path.stem


def default_provider(provider):
    """The provider the chapters will pick, as they print it."""
    code = ("import sys, common.fabric as fi\n"
            f"try: info, why = fi.pick({provider!r})\n"
            "except ValueError as e: sys.exit(str(e))\n"
            "print(fi.provider_of(info), '-', why)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=local_env(), cwd=ROOT)
    if done.returncode:
        sys.exit(f"tour: {(done.stderr or done.stdout).strip().splitlines()[-1]}")
    return done.stdout.strip()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-p", "--provider", help="run every chapter on this provider")
    args = p.parse_args()
    print(f"provider: {default_provider(args.provider)}\n")
    rows = []
    for path in sorted((ROOT / "chapters").glob("[0-9][0-9]_*.py")):
        number = int(path.name[:2])
        step = STEPS.get(number)
        ok, result = step(args.provider) if step else (None, ["no tour step"])
        rows.append((path.stem, title(path), result[0], {True: "ok", False: "FAILED",
                                                        None: "skipped"}[ok]))
        print(f"  {path.stem}: {rows[-1][3]}", flush=True)
    widths = [max(len(r[i]) for r in rows + [("chapter", "what it shows", "result", "status")])
              for i in range(4)]
    print()
    for row in [("chapter", "what it shows", "result", "status")] + rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    failed = [r[0] for r in rows if r[3] == "FAILED"]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} chapters ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

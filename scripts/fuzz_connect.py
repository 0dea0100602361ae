"""Lies at a chapter's server: seeded CONNECTs and control messages that are wrong, sent at the
real server, which must say one line about each and then serve an honest client.

For each chapter and provider it starts the chapter's server (--timeout 2, serving any
number of clients), opens one endpoint of its own on the same provider and sends lies built
from the chapter's own formats (common/chaos/lies.py, from the structs of the chapter and
of common/fabric/connect.py, imported, never written again): a CONNECT truncated or padded, every field at 0 or at its
largest, one field negative, fields inconsistent with one another (buffers smaller than a
page, more pages than buffers, counts larger than what follows, keys of no region,
addresses of nowhere), an address of nobody, another chapter's number, the same CONNECT
twice, a message that is no CONNECT, and a plausible CONNECT followed by a wrong control
message (a LANDED that lies, garbage in its place, or nothing). After each lie the server
must be running, and within its --timeout + 5 s have written exactly the lines the lie
earns on stderr (one per client it makes up), no traceback; chapter 18's decoder, which
serves one request, may instead end on a request that reaches nobody, in one line. Every
--every lies and at the end the chapter's honest client runs, and must succeed with 0
wrong bytes. Lie K of a --seed, chapter and provider is always the same lie: `--only K`
reruns it. With --address the script is one lying client of an already running server
(scripts/chaos.py's): it sends lie K and exits 0 once sent, after printing what the server
answered within a second.

    .venv/bin/python scripts/fuzz_connect.py --lies 50
    .venv/bin/python scripts/fuzz_connect.py --chapters 07 --providers tcp --seed 3 --only 17
    .venv/bin/python scripts/fuzz_connect.py --address ADDR --chapter 07 -p shm --seed 3 --lie 17
"""
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import common  # noqa: F401  first: Ctrl-C is one line from here on (common/bounds.py)
import common.fabric as fi
from common import cli, records, usage
from common.chaos.lies import CHAPTERS, KINDS, ROOM, TOKENS, Me, lie
from common.chapter_pair import ADDRESS, ROOT, _Collector, chapter_path, local_env, stop
from common.fabric import connect, ffi, lib, memory
from common.launch import owned
from common.patience import patience
from common.transfer import wire

PROVIDERS = ("shm", "tcp")
TIMEOUT = 2.0     # the server's --timeout
SETTLE = 0.3      # seconds after a lie's last line during which no other may come
WRONG = re.compile(r"\b[1-9]\d* wrong bytes")
RING = 8           # receives kept posted for the server's answers
KV_TIMEOUT = 5.0   # chapter 18's decoder's --timeout (server_args)


def honest_args(chapter):
    """The honest client's flags (after the server's address): small and quick."""
    pages = ["--page-size", "4K", "--buffer-size", "1M", "--pages", "0-15"]
    return {"05": ["hello"], "06": pages, "18": ["--tokens", TOKENS]}.get(
        chapter, [*pages, "--iters", "1000"])


def server_args(chapter):
    """Flags after --timeout 2. Chapter 18's decoder waits 10 x --timeout for its request,
    which an honest prefiller sends once it has computed the prompt alone (prefill_alone):
    seconds of a busy machine."""
    return ["--tokens", TOKENS, "--timeout", f"{KV_TIMEOUT:g}"] if chapter == "18" else []


# --- the liar: one endpoint of ours ---------------------------------------------------

class Liar:
    """Our endpoint on the server's provider: receives posted for whatever the server
    answers, two buffers a WRITE may reach, and a SEND of any length up to twice
    fabric.max_send."""

    def __init__(self, own, provider, chapter):
        caps = lib.FI_MSG | (0 if chapter == "05" else lib.FI_RMA)
        self.info, _ = fi.pick(provider, caps)
        self.domain, self.cq, av, self.ep = fi.open_endpoint(own, self.info)
        self.av, self.poller, self.size = av, fi.Poller(self.cq), fi.max_send(self.info)
        self.ring = ffi.new("char[]", self.size * RING)
        self.ring_desc = fi.mr_desc(own(fi.mr_reg(self.domain, self.ring, self.size * RING,
                                                  lib.FI_RECV, key=7001)))
        self.recv_ctx = ffi.new("struct fi_context2[]", RING)
        for i in range(RING):
            self._post(i)
        self.out = ffi.new("char[]", 2 * self.size + 64)
        self.out_desc = fi.mr_desc(own(fi.mr_reg(self.domain, self.out, len(self.out),
                                                 lib.FI_SEND, key=7002)))
        self.send_ctx = ffi.new("struct fi_context2 *")
        self.buffers, regions = [], []
        if caps & lib.FI_RMA:
            for i in range(2):
                buf = ffi.new("char[]", ROOM)
                mr = own(fi.mr_reg(self.domain, buf, ROOM, memory.WRITE_TARGET, key=7010 + i))
                self.buffers.append(buf)
                regions.append((fi.remote_base(self.info, fi.key(buf)), ROOM, fi.mr_key(mr)))
        self.me = Me(fi.getname(self.ep), fi.name_of(self.info), regions, self.size,
                     oversize=provider != "shm")
        self.heard, self.errors = [], 0

    def _post(self, i):
        if not fi.recvmsg(self.ep, self.ring + i * self.size, self.size, self.ring_desc,
                          lib.FI_ADDR_UNSPEC, self.recv_ctx + i):
            raise fi.FabricError("fi_recvmsg", -lib.FI_EAGAIN)

    def pump(self):
        """Read our CQ (tcp moves the server's WRITEs into us only then), keep what came."""
        try:
            self.poller.poll()
        except fi.CompletionError:  # a SEND of ours to a server that dropped it: its line
            self.errors += 1       # says so
        for i in range(RING):
            k = fi.key(self.recv_ctx + i)
            if k in self.poller.done:
                length = self.poller.done.pop(k)
                self.heard.append(ffi.buffer(self.ring + i * self.size, length)[:])
                self._post(i)
        self.poller.remote_data.clear()

    def send(self, dest, message, timeout):
        """SEND `message`; False if the provider would not take or complete it."""
        self.out[0:len(message)] = message
        try:
            self.poller.until_posted(lambda: fi.sendmsg(self.ep, self.out, len(message),
                                                        self.out_desc, dest, self.send_ctx),
                                     timeout, "our lie accepted", self.ep)
            self.poller.wait([self.send_ctx], timeout, "our lie's completion")
            return True
        except (fi.FabricError, TimeoutError):
            return False


# --- a server under lies --------------------------------------------------------------

class Server:
    """A chapter's server in a session of its own, its lines collected as they come."""

    def __init__(self, chapter, provider):
        self.args = [sys.executable, str(chapter_path(chapter)), "-p", provider,
                     "--timeout", f"{TIMEOUT:g}", *server_args(chapter)]
        self.timeout = KV_TIMEOUT if chapter == "18" else TIMEOUT
        self.proc = owned(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=local_env(), cwd=ROOT)
        self.readers = [_Collector(self.proc.stdout), _Collector(self.proc.stderr)]
        self.out, self.err = self.readers[0].lines, self.readers[1].lines
        deadline = time.monotonic() + patience(30)
        while not ADDRESS.search("".join(self.out)) and self.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        found = ADDRESS.search("".join(self.out))
        self.address = bytes.fromhex(found[1]) if found else None

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        """Ctrl-C, as a reader would: exit 130 within 2 s (or 0: chapter 18's decoder, done
        with its request, may end by itself meanwhile), or a problem."""
        if not self.alive():
            return None
        stop(self.proc, patience(2))
        for r in self.readers:
            r.join(1)
        return None if self.proc.returncode in (0, 130) else \
            f"the server ended {self.proc.returncode} on Ctrl-C, not 130"


@dataclass
class Cell:
    chapter: str
    provider: str
    tried: list = field(default_factory=list)    # (lie, problems)
    honest: int = 0
    problems: list = field(default_factory=list)
    seconds: float = 0.0


def answer(server, before, lie, liar):
    """The problems of the server's answer to `lie`: stderr lines from `before` on."""
    bound = patience(server.timeout) + 5
    start = time.monotonic()
    wrote = sum(1 for line in server.out if line.startswith("wrote "))

    def lines():
        return [line for line in server.err[before:] if line.strip()]
    last, settled = None, None
    while time.monotonic() - start < bound:
        liar.pump()
        got = len(lines()) + (sum(1 for line in server.out if line.startswith("wrote ")) - wrote
                              if lie.may_write else 0)
        if not server.alive():
            break
        if got != last:
            last, settled = got, time.monotonic()
        if got >= lie.lines and time.monotonic() - settled > SETTLE:
            break
        time.sleep(0.005)
    said, problems = lines(), []
    if not server.alive():
        server.proc.wait()
        for r in server.readers:
            r.join(1)
        said = lines()
        if not (lie.may_end and server.proc.returncode not in (0, None) and len(said) == 1):
            problems.append(f"the server ended (exit {server.proc.returncode})")
    got = len(said) + (sum(1 for line in server.out if line.startswith("wrote ")) - wrote
                       if lie.may_write else 0)
    if any("Traceback" in line for line in said):
        problems.append("a traceback")
    elif got != lie.lines and not problems:
        problems.append(f"{got} lines on stderr within {bound:.0f} s, not {lie.lines}")
    return problems + [f"stderr: {line.strip()[:200]}" for line in said[:4] if problems]


def honest(server, chapter, provider):
    """The chapter's client, which must succeed with 0 wrong bytes; problems, if not."""
    args = [sys.executable, str(chapter_path(chapter)), "-p", provider, "--timeout",
            f"{patience(10):.1f}", server.address.hex(), *honest_args(chapter)]
    before = len(server.err)
    try:
        done = subprocess.run(args, capture_output=True, text=True, env=local_env(), cwd=ROOT,
                              timeout=patience(60))
    except subprocess.TimeoutExpired:
        return ["the honest client did not end within 60 s"]
    problems = []
    if done.returncode != 0 or WRONG.search(done.stdout + done.stderr):
        tail = (done.stderr.strip().splitlines() or [""])[-1][:200]
        problems.append(f"the honest client failed (exit {done.returncode}): {tail}")
    if chapter != "18":
        time.sleep(0.1)
        extra = [line for line in server.err[before:] if line.strip()]
        if extra:
            problems.append(f"the server wrote {extra[0].strip()[:200]!r} serving an honest client")
    return problems


def destination(liar, chapter, address):
    """The server's address in our AV: chapter 18's decoder's is its engine's control one."""
    if chapter == "18":
        address = wire.parse_address(address)[2]
    return fi.av_insert(liar.av, address)


def tell_one(server, chapter, provider, seed, number, cell, kind=None):
    """Lie `number` at `server` (of `kind`, if given), from an endpoint of its own, as every
    client has: on tcp a server's fi_av_remove closes rxm's connection to the last
    client, and a SEND of ours on it meanwhile completes here and is lost there. Its
    problems."""
    with fi.Closer() as own:
        liar = Liar(own, provider, chapter)
        dest = destination(liar, chapter, server.address)
        one = lie(number, seed, chapter, liar.me, kind)
        before = len(server.err)
        for message in one.messages:
            liar.send(dest, message, patience(TIMEOUT))
        problems = answer(server, before, one, liar)
    cell.tried.append((one, problems))
    return problems


def run_cell(chapter, provider, seed, numbers, every):
    cell, started = Cell(chapter, provider), time.monotonic()
    server = Server(chapter, provider)
    try:
        for i, number in enumerate(numbers):
            if server.address is None:
                cell.problems.append("the server printed no address: "
                                     + "".join(server.err[-2:]).strip())
                break
            problems = tell_one(server, chapter, provider, seed, number, cell)
            if not server.alive():  # 18's decoder ended on a request from nobody
                server.stop()
                server = Server(chapter, provider)
            if problems:
                break
            if (i + 1) % every == 0 or i + 1 == len(numbers):
                cell.honest += 1
                bad = honest(server, chapter, provider)
                if bad:
                    cell.problems += [f"after lie {number}: {p}" for p in bad]
                    break
                if chapter == "18":  # its decoder serves one request
                    server.stop()
                    server = Server(chapter, provider)
    finally:
        problem = server.stop()
        if problem and not cell.problems and not any(p for _, p in cell.tried):
            cell.problems.append(problem)
        cell.seconds = time.monotonic() - started
    return cell


# --- one lie at a running server (scripts/chaos.py's lying client) -------------------------

def tell(address, chapter, provider, seed, number):
    with fi.Closer() as own:
        liar = Liar(own, provider, chapter)
        dest = destination(liar, chapter, address)
        one = lie(number, seed, chapter, liar.me)
        print(f"lie {number} ({one.kind}): {one.what}", flush=True)
        for message in one.messages:
            if not liar.send(dest, message, patience(TIMEOUT)):
                print("the server did not take it", flush=True)
                return 0
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not liar.heard:
            liar.pump()
            time.sleep(0.01)
        for message in liar.heard:
            if message.startswith(connect.REFUSED):
                print(f"the server: {message.decode(errors='replace')}")
    return 0


# --- the report -----------------------------------------------------------------------

def table(cells):
    names = list(KINDS)
    head = ["cell"] + [n[:9] for n in names] + ["lies", "failed", "honest", "s"]
    rows = []
    for c in cells:
        per = [sum(1 for lie_, _ in c.tried if lie_.kind == n) for n in names]
        failed = sum(1 for _, p in c.tried if p) + bool(c.problems)
        rows.append([f"{c.chapter} {c.provider}"] + [str(n) if n else "-" for n in per]
                    + [str(len(c.tried)), str(failed), str(c.honest), f"{c.seconds:.0f}"])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in [head] + rows)


def figure(cells):
    tried = sum(len(c.tried) for c in cells)
    survived = sum(1 for c in cells for _, p in c.tried if not p)
    return f"lies {tried}, survived {survived}/{tried}"



def parser():
    p = usage.Parser(prog="fuzz_connect.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--chapters", type=usage.listed(CHAPTERS), default=list(CHAPTERS))
    p.add_argument("--providers", type=usage.listed(PROVIDERS), default=list(PROVIDERS))
    p.add_argument("--lies", type=usage.positive(int), default=25, help="lies per chapter "
                   "and provider (default 25)")
    p.add_argument("--every", type=usage.positive(int), default=25, help="an honest client "
                   "after this many lies, and at the end (default 25)")
    p.add_argument("--seed", type=int, default=0, help="the seed the lies are drawn from")
    p.add_argument("--only", type=usage.positive(int), metavar="K", help="lie K alone")
    p.add_argument("--json", type=records.parse_label, metavar="LABEL",
                   help="write the results to results/chaos/LABEL.json")
    one = p.add_argument_group("one lie at a running server (a lying client)")
    one.add_argument("--address", help="the server's address (hex), as it printed it")
    one.add_argument("--chapter", type=usage.listed(CHAPTERS), help="the server's chapter")
    one.add_argument("-p", "--provider", choices=PROVIDERS)
    one.add_argument("--lie", type=usage.positive(int), metavar="K", help="which lie")
    return p


def main(argv=None):
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.address is not None:
        if not (args.chapter and args.provider and args.lie) or len(args.chapter) != 1:
            p.error("--address needs one --chapter, -p and --lie")
        return tell(cli.parse_address(args.address), args.chapter[0], args.provider,
                    args.seed, args.lie)
    numbers = [args.only] if args.only else list(range(1, args.lies + 1))
    cells = []
    for chapter in args.chapters:
        for provider in args.providers:
            cell = run_cell(chapter, provider, args.seed, numbers, args.every)
            cells.append(cell)
            bad = sum(1 for _, p_ in cell.tried if p_) + len(cell.problems)
            print(f"{chapter} {provider}: {len(cell.tried)} lies, "
                  f"{'FAILED' if bad else 'survived'} ({cell.seconds:.0f} s)", flush=True)
    failed = False
    for c in cells:
        for one, problems in c.tried:
            if problems:
                failed = True
                rerun = shlex.join(["scripts/fuzz_connect.py", "--chapters", c.chapter,
                                    "--providers", c.provider, "--seed", str(args.seed),
                                    "--only", str(one.number)])
                print(f"\nlie {one.number} at {c.chapter} {c.provider} ({one.kind}: {one.what});"
                      f" rerun: {rerun}")
                print("\n".join(f"  {p_}" for p_ in problems))
        if c.problems:
            failed = True
            print(f"\n{c.chapter} {c.provider}:\n" + "\n".join(f"  {p_}" for p_ in c.problems))
    print("\n" + table(cells))
    print(figure(cells))
    if args.json:
        out = records.write_json(ROOT / "results" / "chaos" / f"{args.json}.json", {
            "kind": "fuzz_connect", "command": "python " + shlex.join(
                ["scripts/fuzz_connect.py", *records.arguments(argv)]),
            "machine": records.machine(), "libfabric": "%d.%d" % fi.version(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "git": records.git_sha(), "seed": args.seed, "figure": figure(cells),
            "cells": [{"chapter": c.chapter, "provider": c.provider, "honest": c.honest,
                       "seconds": round(c.seconds, 1), "problems": c.problems,
                       "lies": [{"lie": l.number, "kind": l.kind, "what": l.what,
                                 "problems": p_} for l, p_ in c.tried]} for c in cells]})
        print(f"wrote {out.relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sys.exit(main())
    except (ValueError, fi.FabricError, TimeoutError) as e:  # --address: the server's, wrong
        print(f"fuzz_connect: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("fuzz_connect: interrupted; its servers are stopped", file=sys.stderr)
        sys.exit(130)

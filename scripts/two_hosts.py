"""Two hosts, one command each: chapters 07 and 09-15 between them, beside fi_rma_bw and the blog.

    .venv/bin/python scripts/two_hosts.py --peer HOSTB                          # on host A
    .venv/bin/python scripts/two_hosts.py --peer HOSTA                          # on host B
    MASTER_ADDR=HOSTA MASTER_PORT=29500 .venv/bin/python scripts/two_hosts.py   # on both
    srun -N 2 .venv/bin/python scripts/two_hosts.py -p efa --gpus 0,1,2,3,4,5,6,7

What runs: for each size and repeat, the chapters one after the other (07
and 09-15, or --chapters), rank 0 running each chapter's server (the
writer, whose Gbps count, as in the series) and rank 1 its client; the
server's address reaches the client through the rendezvous, nothing is
pasted. Each NIC moves --bytes a run, as in the series (1,000,000 WRITEs
of 64 KiB in 07 on one NIC, 32,000,000 in 09-15 on 32). Then, as the
same-run baseline, fabtests' `fi_rma_bw -o write` between the same NICs:
one pair on chapter 07's NIC, and for 09-15 one pair per NIC they use (32
on a p5 with --gpus 0,...,7; one per virtual NIC where there are none),
all at once, their Gbps summed. Each pair moves --bytes too, so that the
pairs overlap although they start apart. The figure is the server's, rank
0 -> rank 1, the chapters' direction (with -o write the client writes back
at the same time: bandwidth_rma in fabtests/benchmarks/benchmark_shared.c).
The ceiling is the sum of the NICs' link speeds from fi_info, where the
provider reports them (efa and verbs do, shm and tcp do not).

Who is who: rank 0 serves the rendezvous (chapter 16's, common/launch)
on PORT + 1 and fi_rma_bw's address exchange (-E) on PORT + 2 onwards;
PORT is --port, else MASTER_PORT, else 29500. With --peer each host names
the other and the one with the lower address is rank 0. MASTER_ADDR names
rank 0's host on both; the rank is RANK where set, else 0 on that host and
1 elsewhere. Under Slurm the rank is SLURM_PROCID, and MASTER_ADDR defaults
to the first host of the step's node list. With both "hosts" on one machine
(--peer 127.0.0.1 twice) the one started first is rank 0, and tcp is kept
on loopback (across hosts, set FI_TCP_IFACE to the interface between them).
--rank says it outright.

Checked before anything runs, each in one line: fi_rma_bw (built by
scripts/build_libfabric.sh; --no-baseline runs the chapters alone), the
provider, the GPUs; then that the other host came within --wait seconds,
with the same arguments and as many NICs.

The report, results/two_hosts/<label>-<provider>-<memory>-<time>.json (or
--out), is one file written whole by rank 0, or by rank 1 when rank 0 is
gone: both machines, the libfabric each loaded (path, version) and the one
fi_rma_bw uses, the provider, the NICs, every figure of every repeat, both
sides' commands, and the table printed beside the blog's p5 figures. When a
host's run dies mid-way (killed, crashed) the other stops within a second,
told by the rendezvous; when it goes silent (powered off, cable out), within
--timeout. What was measured until then is written, with "complete": false
and why it stopped, and the last line says why, with exit code 1.
"""
import argparse
import contextlib
import ipaddress
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import common.fabric as fi
from common import bench, bounds, cli
from common.baselines import chapter_args, chapter_list, measure, prefix, rma_bw_command, \
    rma_bw_gbps, rma_bw_tool, tool_env, tools_libfabric
from common.chapter_pair import ADDRESS, ROOT, chapter_path, stop_all
from common.engine import multinet, topo
from common.engine.nics import lane_nics
from common.fabric import lib, memory
from common.launch import Group, PeerGone, Place, owned, place_from_environment
from common.model.journey import blog_percent

CHAPTERS = "7,9,10,11,12,13,14,15"
PORT = 29500            # torchrun's MASTER_PORT, when none is given
GRACE = 10.0            # seconds a program gets to stop on Ctrl-C before it is killed
RETRY_FOR = 10.0        # seconds an fi_rma_bw client retries while its server is not listening
REFUSED = "connect: Connection refused"  # fabtests' words for "no server there yet"


class Failed(ValueError):
    """A step failed on one of the hosts (both hosts know it, and stop)."""


def arguments():
    p = cli.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", help="the other host (each host names the other)")
    p.add_argument("--port", type=cli.count(1, 65000),
                   help=f"PORT + 1 and on are used on rank 0's host (default MASTER_PORT, {PORT})")
    p.add_argument("--rank", type=int, choices=(0, 1),
                   help="this host's rank: 0 runs the servers (default: see the docstring)")
    p.add_argument("-p", "--provider", help="libfabric provider (default: the first of efa, "
                   "verbs, shm, tcp usable here)")
    p.add_argument("--chapters", default=CHAPTERS, help=f"which of them ({CHAPTERS})")
    p.add_argument("--sizes", default="64K", help="page sizes, comma-separated (default 64K)")
    p.add_argument("--bytes", type=cli.parse_size, default=64 << 30,
                   help="bytes each NIC moves in a run (default 64G: the series' 1,000,000 "
                   "WRITEs of 64 KiB per NIC; at least 200 WRITEs)")
    p.add_argument("--repeats", type=cli.count(1, 100), default=3)
    p.add_argument("--gpus", help="GPUs whose memory the chapters use, the same on both "
                   "hosts, e.g. 0,1,2,3 (default: host memory)")
    p.add_argument("--nics-per-gpu", type=cli.count(1, 64),
                   help="09 on: NICs per GPU (default: all of each GPU's; 1 without NICs)")
    p.add_argument("--groups", type=cli.count(1, 64), default=1,
                   help="09 on with host memory: GPUs to stand in for (default 1)")
    p.add_argument("--no-baseline", action="store_true", help="the chapters only, no fi_rma_bw")
    p.add_argument("--label", type=cli.parse_label, default=os.uname().nodename,
                   help="machine name for the report's file")
    p.add_argument("--out", help="the report's file (default results/two_hosts/...)")
    p.add_argument("--timeout", type=float, default=300,
                   help="seconds one run of a chapter or of fi_rma_bw may take (default 300)")
    p.add_argument("--wait", type=float, default=120,
                   help="seconds to wait for the other host (default 120)")
    args = p.parse_args()
    args.chapters = chapter_list(p, args.chapters, [7, *range(9, 16)])
    try:
        args.sizes = [cli.parse_size(s) for s in args.sizes.split(",")]
        args.gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise cli.UsageError(f"--sizes takes sizes like 4K,64K and --gpus numbers like 0,1 "
                             f"({e})") from None
    return args


# --- who is who ---------------------------------------------------------------

def resolve(host):
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"cannot resolve host '{host}': {getattr(e, 'strerror', e)}") from None


def family(address):
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def is_mine(address):
    """Whether `address` belongs to this host (a socket can be bound to it)."""
    with socket.socket(family(address), socket.SOCK_DGRAM) as s:
        try:
            s.bind((address, 0))
            return True
        except OSError:
            return False


def route_to(address):
    """This host's own address on the way to `address` (nothing is sent)."""
    with socket.socket(family(address), socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
        except OSError as e:
            raise ValueError(f"no route to {address}: {e.strerror}") from None
        return s.getsockname()[0]


def first_host(nodelist):
    """The first host of a Slurm node list: 'p5-[003-004,9],login' -> 'p5-003'."""
    prefix_, ranges, suffix = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", nodelist).groups()
    return prefix_ + re.split(r"[-,]", ranges)[0] + suffix if ranges else prefix_


def meeting(args, env):
    """(this host's rank, rank 0's host, PORT, how that was decided). The rank is None when
    both are on this host and nothing says which is which: the first to serve is rank 0."""
    port = args.port or (int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit()
                         else PORT)
    if args.peer:
        far = resolve(args.peer)
        if is_mine(far):
            return args.rank, far, port, "--rank" if args.rank is not None else \
                "both on this host: the first started is rank 0"
        near = route_to(far)
        lower = min(near, far, key=ipaddress.ip_address)
        rank = args.rank if args.rank is not None else int(lower == far)
        return rank, near if rank == 0 else far, port, f"--peer: the lower address, {lower}, " \
            "is rank 0"
    if "RANK" in env or "SLURM_PROCID" in env:
        env = dict(env, MASTER_PORT=str(port))
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        if "MASTER_ADDR" not in env and "RANK" not in env and nodes:
            env["MASTER_ADDR"] = first_host(nodes)
        place = place_from_environment(env)  # RANK or SLURM_PROCID; one line when wrong
        if place.world != 2:
            raise cli.UsageError(f"two hosts, one rank each: the {place.source} say "
                                 f"{place.world} ranks (Slurm: srun -N 2 --ntasks-per-node 1)")
        rank = args.rank if args.rank is not None else place.rank
        return rank, resolve(place.rendezvous[0]), port, place.source
    if "MASTER_ADDR" in env:
        host0 = resolve(env["MASTER_ADDR"])
        rank = args.rank if args.rank is not None else (None if is_mine(host0) else 1)
        return rank, host0, port, "MASTER_ADDR is rank 0's host"
    raise cli.UsageError("where is the other host? --peer HOST (each host names the other), "
                         "or MASTER_ADDR=FIRST_HOST and MASTER_PORT on both, or srun -N 2")


def join(rank, host0, port, how, wait):
    """This host's Group of two (common/launch's rendezvous, served by rank 0)."""
    for r in ([rank] if rank is not None else [0, 1]):
        place = Place(r, 2, 1, None, (host0, port + 1), r == 0, how)
        try:
            return Group(place, timeout=wait)
        except ValueError:  # the rendezvous port is taken: the other one serves it
            if rank is not None:
                raise


# --- what each host has ---------------------------------------------------------

def nic(info, gpu, real):
    return {"fabric": fi.string(info.fabric_attr.name), "domain": fi.string(info.domain_attr.name),
            "gpu": gpu, "gbps": lib.tut_nic_speed(info) / 1e9, "real": real}


def here(args):
    """What this host runs with, checked before anything runs (ValueError: one line)."""
    if not args.no_baseline:
        try:
            rma_bw_tool()
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    for gpu in reversed(args.gpus or []):
        memory.use_gpu(gpu)
    head, why = fi.pick(args.provider, multinet.CAPS, hmem=bool(args.gpus))
    args.provider_used = fi.provider_of(head).split(";")[0]
    real = bool(topo.nics_here(head))  # NICs with PCI addresses; else virtual ones
    first = [nic(head, args.gpus[0] if args.gpus else None, real)]
    lanes, what = first, "no chapter from 09 on"
    if any(c >= 9 for c in args.chapters):  # virtual NICs too: each is a domain of its own
        groups = len(args.gpus) if args.gpus else args.groups
        infos, what = lane_nics(args, head, groups, args.nics_per_gpu)
        lanes = [nic(i, args.gpus[g] if args.gpus else None, real)
                 for g, group in enumerate(infos) for i in group]
    return {"machine": bench.machine(args.gpus[0] if args.gpus else None), "git": bench.git_sha(),
            "command": shown([sys.executable, *sys.argv]),
            "provider": fi.provider_of(head), "provider_why": why,
            "provider_used": args.provider_used,
            "libfabric": {"version": "%d.%d" % fi.version(), "path": fi.loaded_from()},
            "fi_rma_bw": None if args.no_baseline else
            {"path": str(rma_bw_tool()), "libfabric": tools_libfabric()},
            "nic_07": first, "lanes": lanes, "lanes_line": what,
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k.startswith("FI_") or k in ("LIBFABRIC_PREFIX", "LD_LIBRARY_PATH")}}


def settings(args):
    """The arguments both hosts must agree on."""
    return {k: getattr(args, k) for k in ("provider_used", "chapters", "sizes", "bytes", "repeats",
                                          "gpus", "nics_per_gpu", "groups", "no_baseline")}


def stop_both(group, why):
    """Both hosts found `why`: they leave the rendezvous saying goodbye, so that neither
    takes the other's exit for a crash (rank 0's would close it under rank 1), then say it."""
    group.close()
    raise ValueError(why)


def introduce(group, args, mine):
    """Both hosts' `here()`, in rank order; both stop, in one line, on a mismatch."""
    hosts = [json.loads(b) for b in group.allgather(
        json.dumps({"arguments": settings(args), **mine}).encode(), args.wait)]
    a, b = (h["arguments"] for h in hosts)
    differ = [f"{k} {a[k]} (rank 0) / {b[k]} (rank 1)" for k in a if a[k] != b[k]]
    if differ:
        stop_both(group, "the two hosts were started with different arguments: "
                  + "; ".join(differ))
    if len(hosts[0]["lanes"]) != len(hosts[1]["lanes"]):
        stop_both(group, f"rank 0 has {len(hosts[0]['lanes'])} NICs for 09-15, rank 1 "
                  f"{len(hosts[1]['lanes'])}: the chapters and fi_rma_bw pair them one to one")
    for h in hosts:
        del h["arguments"]  # the same on both: the report says them once
    return hosts, a


# --- one step, on both hosts ------------------------------------------------------

def shown(command):
    """A command as it is pasted in the repository's root."""
    inside = str(ROOT) + os.sep
    return shlex.join(os.path.relpath(a, ROOT) if a.startswith(inside) else a for a in command)


class Program:
    """One program of a step on this host; its output goes to a file read as it grows. It
    ends with this host's run however that ends: stopped by us, or sent SIGTERM by the
    kernel when we die (common.launch.owned)."""

    def __init__(self, command, folder, env):
        self.command = command
        fd, self.log = tempfile.mkstemp(dir=folder, suffix=".log")
        with os.fdopen(fd, "w") as out:
            self.proc = owned(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def output(self):
        return Path(self.log).read_text(errors="replace")

    def outcome(self, stopped=False):
        rc = self.proc.returncode
        last = ([line for line in self.output().splitlines() if line.strip()] or [f"exit {rc}"])[-1]
        return {"command": shown(self.command), "rc": rc, "stopped": stopped,
                "error": None if rc == 0 else last}


def watch(group, programs, timeout, until=lambda: False):
    """Wait until every program has ended (or `until()`), asking the rendezvous all along
    whether the other host is still there (PeerGone when it is not)."""
    deadline = time.monotonic() + timeout
    while not until() and any(p.proc.poll() is None for p in programs):
        group.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"'{shown(programs[0].command)}' still running after "
                               f"{timeout:g} s (--timeout)")
        time.sleep(0.02)


class Steps:
    """This host's half of each step, in step with the other host's: at every exchange both
    hosts say what they have, so both know, and both stop when one side failed."""

    def __init__(self, group, args, hosts, host0, port):
        self.group, self.args, self.hosts, self.host0, self.port = group, args, hosts, host0, port
        self.rank = group.rank
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.running = []

    @contextlib.contextmanager
    def step(self):
        """A folder for one step's programs; however the step ends, none is left running."""
        self.running = []
        with tempfile.TemporaryDirectory() as folder:
            try:
                yield folder
            finally:  # after Ctrl-C or SIGTERM, within this host's own bound (bounds.tidy)
                stop_all([p.proc for p in self.running],
                         bounds.tidy(GRACE) if bounds.signalled() else GRACE)

    def start(self, command, folder, env=None):
        """Start a program and remember it. A Ctrl-C or SIGTERM that comes meanwhile waits
        until it is remembered: however this host stops, no program of its runs on."""
        came = []
        held = {s: signal.signal(s, lambda signum, _: came.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.running.append(Program(command, folder, env or self.env))
        finally:
            for s, handler in held.items():
                signal.signal(s, handler)
        if came:
            signal.raise_signal(came[0])  # now to the handler held back: KeyboardInterrupt
        return self.running[-1]

    def swap(self, mine=None):
        """[rank 0's, rank 1's]: what each side passed (JSON), once both have."""
        return [json.loads(b) for b in self.group.allgather(json.dumps(mine).encode(),
                                                            self.args.timeout + 30)]

    def settle(self, what, outcomes):
        """Raise Failed naming the side that failed (not the one stopped for it)."""
        failed = [(r, o) for r, o in enumerate(outcomes) if o["error"]]
        failed.sort(key=lambda f: f[1]["stopped"])
        if failed:
            rank, o = failed[0]
            raise Failed(f"{what} failed on rank {rank} "
                         f"({self.hosts[rank]['machine']['host']}): {o['error']}")
        return {f"rank {r}": o["command"] for r, o in enumerate(outcomes)}

    def finish(self, programs, theirs):
        """Rank 0, once rank 1 has reported: wait for its own programs, or stop them at once
        when rank 1 failed (they would wait for it in vain)."""
        if theirs["error"]:
            stop_all([p.proc for p in programs], GRACE)
            return [p.outcome(stopped=True) for p in programs]
        watch(self.group, programs, self.args.timeout)
        return [p.outcome() for p in programs]

    def chapter(self, number):
        """measure()'s tool for one chapter: rank 0 its server, rank 1 its client."""
        def run(size, iters):
            if number >= 9:  # as in the series: each NIC moves what 07's one moves
                iters *= len(self.hosts[0]["lanes"])
            server, client = chapter_args(number, size, iters, self.args.nics_per_gpu,
                                          self.args.groups, self.args.gpus)
            command = [sys.executable, str(chapter_path(number)), "-p", self.args.provider_used]
            with self.step() as tmp:
                if self.rank == 0:
                    record = Path(tmp) / "run.json"
                    me = self.start(command + server + ["--clients", "1", "--json", str(record)],
                                    tmp)
                    watch(self.group, [me], self.args.timeout,
                          until=lambda: ADDRESS.search(me.output()))
                    found = ADDRESS.search(me.output())
                    self.swap(found and found[1])
                    theirs = self.swap()[1]
                    [mine] = self.finish([me], theirs)
                    if not mine["error"] and not record.exists():
                        mine["error"] = f"no figures: {me.output().strip()[-300:]}"
                    mine["gbps"] = record.exists() and json.loads(record.read_text())["gbps"]
                    outcomes = [self.swap(mine)[0], theirs]
                else:
                    address = self.swap()[0]
                    if address:
                        me = self.start(command + [address] + client, tmp)
                        watch(self.group, [me], self.args.timeout)
                        mine = me.outcome()
                    else:
                        mine = {"command": None, "stopped": True,
                                "error": "the server printed no address"}
                    self.swap(mine)
                    outcomes = [self.swap()[0], mine]
            return outcomes[0]["gbps"], self.settle(f"chapter {number:02d}", outcomes)
        return run

    def rma_bw(self, nics, name):
        """measure()'s tool for fi_rma_bw -o write on each pair of `nics` ("nic_07" or
        "lanes", from here()) at once, summed."""
        def run(size, iters):
            def command(i, nic):
                return rma_bw_command(self.args.provider_used, "write", size, iters, nic["gpu"],
                                      self.port + 2 + i,
                                      (nic["fabric"], nic["domain"]) if nic["real"] else None)
            with self.step() as tmp:
                mine = [command(i, n) for i, n in enumerate(self.hosts[self.rank][nics])]
                if self.rank == 0:
                    servers = [self.start(c, tmp, tool_env()) for c in mine]
                    self.swap()  # started: the clients may come
                    theirs = self.swap()[1]
                    outcome = self.merge(self.finish(servers, theirs))
                    try:
                        outcome["gbps"] = sum(rma_bw_gbps(p.output()) for p in servers)
                    except RuntimeError as e:  # said to rank 1 too, below
                        outcome["error"] = outcome["error"] or str(e)
                    outcomes = [self.swap(outcome)[0], theirs]
                else:
                    self.swap()
                    clients = self.clients([c + [self.host0] for c in mine], tmp)
                    outcome = self.merge([p.outcome() for p in clients])
                    self.swap(outcome)
                    outcomes = [self.swap()[0], outcome]
            return outcomes[0]["gbps"], self.settle(name, outcomes)
        return run

    def clients(self, commands, folder):
        """fi_rma_bw clients, each started again while its server does not listen yet."""
        programs = [self.start(c, folder, tool_env()) for c in commands]
        deadline = time.monotonic() + RETRY_FOR

        def refused():
            return [i for i, p in enumerate(programs) if p.proc.poll() not in (None, 0)
                    and REFUSED in p.output()]
        while True:
            watch(self.group, programs, self.args.timeout, until=refused)
            again = refused()
            if not again or time.monotonic() > deadline:
                watch(self.group, programs, self.args.timeout)
                return programs
            time.sleep(0.2)
            for i in again:
                programs[i] = self.start(programs[i].command, folder, tool_env())

    @staticmethod
    def merge(outcomes):
        """Several programs' outcomes as one: every command, the first error."""
        error = next((o for o in outcomes if o["error"]), None)
        return {"command": [o["command"] for o in outcomes], "error": error and error["error"],
                "stopped": all(o["stopped"] for o in outcomes)}


# --- the table and the report ----------------------------------------------------

def tools(steps, args, hosts):
    """measure()'s tools: the chapters, then fi_rma_bw on 07's NIC and on 09-15's NICs."""
    chosen = [(f"chapter {c:02d}", steps.chapter(c)) for c in args.chapters]
    if args.no_baseline:
        return chosen, {}
    one = "fi_rma_bw, 1 NIC pair"
    chosen.append((one, steps.rma_bw("nic_07", one)))
    baselines = {c: one for c in args.chapters}
    pairs = len(hosts[0]["lanes"])
    if pairs > 1 and max(args.chapters) >= 9:
        many = f"fi_rma_bw, {pairs} NIC pairs"
        chosen.append((many, steps.rma_bw("lanes", many)))
        baselines.update({c: many for c in args.chapters if c >= 9})
    return chosen, baselines


def median(row):
    return row.get("median_gbps") or (statistics.median(row["gbps"]) if row["gbps"] else None)


def table(rows, hosts, baselines):
    """One line per chapter and size: ours, % of the same-run fi_rma_bw and of the links,
    and the series' p5 figure (07: % of one NIC, 09-15: of 32)."""
    blog = json.loads((ROOT / "results" / "blog_p5.json").read_text())
    lines = []
    for row in rows:
        chapter = row["tool"][-2:]
        gbps = median(row)
        if not row["tool"].startswith("chapter ") or gbps is None:
            continue
        base = next((median(r) for r in rows if r["size"] == row["size"]
                     and r["tool"] == baselines.get(int(chapter))), None)
        nics = "nic_07" if chapter == "07" else "lanes"
        links = min(sum(n["gbps"] for n in h[nics]) for h in hosts) or None
        p5 = blog["chapters"].get(chapter, {})
        lines.append({"chapter": chapter, "size": row["size"], "gbps": gbps,
                      "mpps": round(gbps * 1e9 / 8 / row["size"] / 1e6, 4),
                      "baseline": baselines.get(int(chapter)), "baseline_gbps": base,
                      "percent_of_baseline": base and round(100 * gbps / base, 3),
                      "links_gbps": links,
                      "percent_of_links": links and round(100 * gbps / links, 3),
                      "p5_gbps": p5.get("gbps"),
                      "p5_percent": round(blog_percent(blog, chapter), 1) if p5 else None})
    return lines


def percent(value):
    if value is None:
        return "-"
    return f"{value:.1f}%" if value >= 1 else f"{value:.2g}%"


def described(machine):
    gpu = f", {machine['gpu']}" if machine["gpu"] else ""
    return f"{machine['host']} ({machine['cpu']}, {machine['cores']} cores{gpu})"


def show(lines, rows, hosts, repeats, moved, memory_kind):
    lf, tool = hosts[0]["libfabric"], hosts[0]["fi_rma_bw"]
    print(f"\n{described(hosts[0]['machine'])} -> {described(hosts[1]['machine'])}; "
          f"{memory_kind} memory; provider {hosts[0]['provider']} ({hosts[0]['provider_why']}); "
          f"libfabric {lf['version']} ({lf['path']})"
          + (f"; fi_rma_bw {tool['path']} (libfabric {tool['libfabric']})" if tool else ""))
    print(f"{'chapter':<9}{'size':>9}{'Gbps':>10}{'Mpps':>8}{'% fi_rma_bw':>13}{'% links':>9}"
          f"{'p5 Gbps':>10}{'p5 %':>7}")
    for t in lines:
        p5 = f"{t['p5_gbps']:>10.1f}{t['p5_percent']:>6.1f}%" if t["p5_gbps"] else ""
        print(f"{t['chapter']:<9}{t['size']:>9}{t['gbps']:>10.3f}{t['mpps']:>8.3f}"
              f"{percent(t['percent_of_baseline']):>13}{percent(t['percent_of_links']):>9}{p5}")
    for row in rows:
        if row["tool"].startswith("fi_rma_bw") and median(row) is not None:
            print(f"{row['tool']}, {row['size']} B: {median(row):.3f} Gbps")
    print(f"Gbps: medians of {repeats} runs of {moved} bytes per NIC (at least 200 WRITEs); "
          "p5: the series (07: % of one 100 Gbps NIC, 09-15: % of 32)")
    if tool and not f"{tool['libfabric']}.".startswith(lf["version"] + "."):
        print(f"note: the chapters loaded libfabric {lf['version']}, fi_rma_bw uses "
              f"{tool['libfabric']}; for one library on both sides build the binding against "
              f"fi_rma_bw's: LIBFABRIC_PREFIX={shlex.quote(str(prefix()))} bash scripts/setup.sh")


def report_path(args, memory_kind):
    if args.out:
        return Path(args.out)
    return bench.RESULTS / "two_hosts" / (f"{args.label}-{args.provider_used}-{memory_kind}-"
                                          + time.strftime("%Y%m%dT%H%M%S") + ".json")


def write_report(args, agreed, hosts, rows, lines, stopped):
    memory_kind = "cuda" if args.gpus else "host"
    data = {"kind": "two_hosts", "complete": stopped is None, "stopped": stopped,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "provider": hosts[0]["provider"], "provider_why": hosts[0]["provider_why"],
            "memory": memory_kind,
            "arguments": agreed, "hosts": hosts,
            "runs": [r for r in rows if r["gbps"]], "table": lines}
    path = bench.write_json(report_path(args, memory_kind), data)
    shown_path = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"wrote {shown_path}: the report to send back")


def main():
    args = arguments()
    rank, host0, port, how = meeting(args, os.environ)
    if ipaddress.ip_address(host0).is_loopback:  # both on this machine: tcp on loopback
        os.environ.setdefault("FI_TCP_IFACE", "lo")
    mine = here(args)  # before anything runs
    print(f"two_hosts: meeting at {host0}:{port + 1} ({how}); {mine['lanes_line']}", flush=True)
    with join(rank, host0, port, how, args.wait) as group:
        print(f"two_hosts: rank {group.rank} ({'servers' if group.rank == 0 else 'clients'})",
              flush=True)
        hosts, agreed = introduce(group, args, mine)
        steps = Steps(group, args, hosts, host0, port)
        chosen, baselines = tools(steps, args, hosts)
        rows, stopped = [], None
        try:
            measure(chosen, args.sizes, args.repeats, args.bytes, rows)
        except (PeerGone, Failed, TimeoutError, KeyboardInterrupt) as e:
            stopped = e
        lines = table(rows, hosts, baselines)
        show(lines, rows, hosts, args.repeats, args.bytes, "GPU" if args.gpus else "host")
        # rank 0 writes; rank 1 only when rank 0 is gone (or silent), with what it has
        if group.rank == 0 or isinstance(stopped, (PeerGone, TimeoutError)):
            why = stopped and (str(stopped) or "interrupted (Ctrl-C or SIGTERM)")
            write_report(args, agreed, hosts, rows, lines, why or None)
        else:
            print(f"two_hosts: the report is written on rank 0 ({hosts[0]['machine']['host']})")
        if stopped:
            raise stopped


if __name__ == "__main__":
    cli.run(main)

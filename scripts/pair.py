"""Run a chapter's server and client(s) together on this host.

Starts the server, reads the address it prints, runs each client against it,
then waits for the server to finish (or stops it with Ctrl-C, as you would).
The server is also stopped on any failure, so nothing is left running.

    .venv/bin/python scripts/pair.py 04                          # default provider
    .venv/bin/python scripts/pair.py 05 -p tcp --clients 3 -- "some text"
    .venv/bin/python scripts/pair.py 04 -p shm --server-args="--timeout 5" -- "hi" --timeout 3
    .venv/bin/python scripts/pair.py 18 --limit 600 --server-args="--tokens 16384" -- --tokens 16384

Also a library: tests and the tour call run_pair().
"""
import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common import usage  # noqa: E402
from common.patience import patience  # noqa: E402
ADDRESS = re.compile(r"^server address: ([0-9a-f]+)$", re.MULTILINE)


def chapter_path(number):
    """chapters/NN_*.py for a chapter number ('4', '04' or 4)."""
    found = sorted((ROOT / "chapters").glob(f"{int(number):02d}_*.py"))
    if not found:
        raise FileNotFoundError(f"no chapter {int(number):02d} in {ROOT / 'chapters'}")
    return found[0]


def local_env(extra=None):
    """The environment for runs on one host: tcp kept on loopback, output unbuffered."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("FI_TCP_IFACE", "lo")
    env.update(extra or {})
    return env


@dataclass
class Run:
    args: list
    rc: int = None
    out: str = ""
    err: str = ""


@dataclass
class Pair:
    server: Run
    clients: list = field(default_factory=list)
    stopped: bool = False  # we had to Ctrl-C the server after its clients were done

    @property
    def ok(self):
        """Every client succeeded and the server exited cleanly (by itself or on Ctrl-C)."""
        server_ok = self.server.rc == 0 or (self.stopped and self.server.rc == 130)
        return server_ok and bool(self.clients) and all(c.rc == 0 for c in self.clients)


class _Collector(threading.Thread):
    """Reads one stream of a process to the end without blocking the caller."""

    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.lines = stream, []
        self.start()

    def run(self):
        for line in self.stream:
            self.lines.append(line)

    @property
    def text(self):
        return "".join(self.lines)


def stop(proc, grace):
    """Ctrl-C first (the chapter closes its resources), then a kill if it ignores it.

    Returns whether the process was still running.
    """
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return True


def run_pair(chapter, provider=None, server_args=(), client_args=((),), env=None,
             timeout=60.0, grace=10.0, keep_going=False):
    """Start the server, run one client per entry of `client_args`, stop the server.

    Returns a Pair with each process's arguments, exit code and output. A
    server that prints no address within `timeout` gets no client; after a
    client fails, no further client runs unless `keep_going`. Both limits are
    for a quiet machine and stretch with this one's load.
    """
    timeout, grace = patience(timeout), patience(grace)
    path = chapter_path(chapter)
    common = ["-p", provider] if provider else []
    env = local_env(env)
    server = Run([sys.executable, str(path), *common, *server_args])
    proc = subprocess.Popen(server.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=ROOT)
    out, err = _Collector(proc.stdout), _Collector(proc.stderr)
    pair = Pair(server)
    try:
        deadline = time.monotonic() + timeout
        while not ADDRESS.search(out.text) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        found = ADDRESS.search(out.text)
        for args in client_args if found else ():
            client = Run([sys.executable, str(path), *common, found[1], *args])
            try:
                done = subprocess.run(client.args, capture_output=True, text=True, env=env,
                                      cwd=ROOT, timeout=timeout)
                client.rc, client.out, client.err = done.returncode, done.stdout, done.stderr
            except subprocess.TimeoutExpired as e:
                client.rc, client.err = -signal.SIGKILL, f"client killed after {timeout:g} s\n"
                client.out = e.stdout.decode() if e.stdout else ""
            pair.clients.append(client)
            if client.rc != 0 and not keep_going:
                break
        if len(pair.clients) == len(client_args) and (keep_going or pair.clients[-1].rc == 0):
            try:
                proc.wait(grace)  # a server told how many clients to serve exits by itself
            except subprocess.TimeoutExpired:
                pass
    finally:
        pair.stopped = stop(proc, grace)
        out.join(grace)
        err.join(grace)
    server.rc, server.out, server.err = proc.returncode, out.text, err.text
    return pair


def seconds(text):
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"not a number of seconds: '{text}'")
    return value


def main():
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("chapter", help="chapter number, e.g. 04")
    p.add_argument("-p", "--provider")
    p.add_argument("--clients", type=int, default=1, help="how many clients to run in turn")
    p.add_argument("--server-args", default="", help="extra server arguments, one string")
    p.add_argument("--limit", type=seconds, default=60.0, metavar="S",
                   help="seconds the server may take to print its address and each client "
                        "to run (default 60; stretched when the machine is busy)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.client_args = argv[split + 1:]  # everything after -- goes to the client
    try:
        pair = run_pair(args.chapter, args.provider, shlex.split(args.server_args),
                        [args.client_args] * args.clients, timeout=args.limit)
    except FileNotFoundError as e:
        sys.exit(f"pair: {e}")
    for name, run in [("server", pair.server)] + [(f"client {i + 1}", c)
                                                    for i, c in enumerate(pair.clients)]:
        print(f"--- {name}: {shlex.join(run.args[1:])} -> exit {run.rc}")
        sys.stdout.write(run.out + run.err)
    if not pair.clients:
        print("--- no client ran: the server printed no address")
    return 0 if pair.ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""A chapter's server and client(s) run together on this host, as a library.

run_pair() starts the server, reads the address it prints, runs each client against
it, then waits for the server to finish (or stops it with Ctrl-C, as a reader would),
and returns each side's arguments, exit code and output. scripts/pair.py is its
command line; the tour, the benchmark scripts and the tests call it.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import shm_files
from common.launch import owned
from common.patience import patience

ROOT = Path(__file__).resolve().parents[1]
ADDRESS = re.compile(r"^server address: ([0-9a-f]+)$", re.MULTILINE)
INTERRUPTED_WAIT = 1.5  # seconds both sides get to close after our Ctrl-C: all ends in 2 s


def chapter_path(number):
    """chapters/NN_*.py for a chapter number ('4', '04' or 4)."""
    found = sorted((ROOT / "chapters").glob(f"{int(number):02d}_*.py"))
    if not found:
        raise FileNotFoundError(f"no chapter {int(number):02d} in {ROOT / 'chapters'}")
    return found[0]


def chapter_module(number):
    """A chapter imported as a module (its main() not run), for tests of its parts."""
    spec = importlib.util.spec_from_file_location(f"chapter{int(number):02d}",
                                                  chapter_path(number))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    """Reads one stream of a process to the end without blocking the caller; each line
    also goes to `echo` (a stream) as it comes, after `prefix`."""

    def __init__(self, stream, prefix="", echo=None):
        super().__init__(daemon=True)
        self.stream, self.prefix, self.echo, self.lines = stream, prefix, echo, []
        self.start()

    def run(self):
        for line in self.stream:
            self.lines.append(line)
            if self.echo is not None:
                self.echo.write(self.prefix + line)
                self.echo.flush()

    @property
    def text(self):
        return "".join(self.lines)


class _Process:
    """One side: started as ours (common.launch.owned: it dies with us, and only we signal
    it), its output collected as it comes."""

    def __init__(self, run, name, env, echo):
        self.run, self.name, self.said = run, name, ""
        self.proc = owned(run.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env, cwd=ROOT)
        out, err = echo or (None, None)
        self.out = _Collector(self.proc.stdout, f"{name}: ", out)
        self.err = _Collector(self.proc.stderr, f"{name}: ", err)

    def say(self, line):
        """A line of ours about this side: in its Run's err, and to our reader."""
        self.said += line + "\n"
        if self.err.echo is not None:
            self.err.echo.write(f"{self.name}: {line}\n")

    def say_if_killed(self):
        """One line for our reader if Ctrl-C was not enough."""
        if self.proc.returncode == -signal.SIGKILL:
            self.say(f"killed: not closed within {INTERRUPTED_WAIT:g} s of Ctrl-C")

    def finish(self, grace):
        """Its end as the Run's exit code and output; what it left in /dev/shm if killed."""
        self.out.join(grace)
        self.err.join(grace)
        self.run.rc, self.run.out = self.proc.returncode, self.out.text
        self.run.err = self.said + self.err.text
        if self.proc.returncode < 0:  # a killed process removed nothing
            shm_files.remove_left_by([self.proc.pid])


def stop(proc, grace):
    """Ctrl-C first (the chapter closes its resources), then a kill if it ignores it (and
    what it left in /dev/shm removed).

    Returns whether the process was still running.
    """
    return bool(stop_all([proc], grace))


def stop_all(procs, grace):
    """stop() for each of `procs` at once: all are signalled, then those still running
    `grace` s later killed. Returns those that were running."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.send_signal(signal.SIGINT)
        p.send_signal(signal.SIGCONT)  # a stopped process acts on it only then
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            shm_files.remove_left_by([p.pid])
    return running


def run_one(args, timeout, env=None):
    """Run one program of ours to its end (a chapter that needs no peer, or scripts/launch.py
    and its ranks), owned as run_pair's sides are, its output captured: a CompletedProcess.
    Past `timeout` (for a quiet machine: stretched with this one's load) it is stopped, and
    its stderr ends with a line that says so; on our Ctrl-C or SIGTERM it is stopped (a
    launcher then stops its ranks) before the KeyboardInterrupt goes on to the caller."""
    proc = owned(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 env=local_env(env), cwd=ROOT)
    timeout = patience(timeout)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc, INTERRUPTED_WAIT)
        out, err = proc.communicate()
        err += f"stopped: still running after {timeout:.0f} s (the limit)\n"
    except BaseException:
        stop(proc, INTERRUPTED_WAIT)
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def run_pair(chapter, provider=None, server_args=(), client_args=((),), env=None,
             timeout=60.0, grace=10.0, keep_going=False, echo=None):
    """Start the server, run one client per entry of `client_args`, stop the server.

    Returns a Pair with each process's arguments, exit code and output. A
    server that prints no address within `timeout` gets no client; after a
    client fails, no further client runs unless `keep_going`. Both limits are
    for a quiet machine and stretch with this one's load.
    echo: (out, err) streams that each side's lines go to as they come, named.
    A KeyboardInterrupt here stops both sides within INTERRUPTED_WAIT s, then
    goes on to the caller.
    """
    timeout, grace = patience(timeout), patience(grace)
    path = chapter_path(chapter)
    common = ["-p", provider] if provider else []
    env = local_env(env)
    server = _Process(Run([sys.executable, str(path), *common, *server_args]), "server",
                      env, echo)
    pair, client = Pair(server.run), None
    try:
        deadline = time.monotonic() + timeout
        while not ADDRESS.search(server.out.text) and server.proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        found = ADDRESS.search(server.out.text)
        for args in client_args if found else ():
            client = _Process(Run([sys.executable, str(path), *common, found[1], *args]),
                              f"client {len(pair.clients) + 1}", env, echo)
            try:
                client.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                client.proc.kill()
                client.proc.wait()
                client.say(f"killed: still running after {timeout:.1f} s (the limit)")
            client.finish(grace)
            pair.clients.append(client.run)
            client = None
            if pair.clients[-1].rc != 0 and not keep_going:
                break
        if len(pair.clients) == len(client_args) and (keep_going or pair.clients[-1].rc == 0):
            try:
                server.proc.wait(grace)  # a server told how many clients to serve exits
            except subprocess.TimeoutExpired:
                pass
    except BaseException:  # Ctrl-C (or SIGTERM, as scripts/pair.py turns it): both sides, now
        sides = [side for side in (client, server) if side is not None]
        stop_all([side.proc for side in sides], INTERRUPTED_WAIT)
        for side in sides:
            side.say_if_killed()
        raise
    finally:
        pair.stopped = stop(server.proc, grace)
        server.finish(grace)
    return pair

"""Run a chapter's server and client(s) together on this host.

Starts the server, reads the address it prints, runs each client against it,
then waits for the server to finish (or stops it with Ctrl-C, as you would).
Each line either side prints comes out as it comes, after its name ("server: ",
"client 1: "). The server is also stopped on any failure, and both sides on
Ctrl-C of this script (within 2 s), so nothing is left running or in /dev/shm.

    .venv/bin/python scripts/pair.py 04                          # default provider
    .venv/bin/python scripts/pair.py 05 -p tcp --clients 3 -- "some text"
    .venv/bin/python scripts/pair.py 04 -p shm --server-args="--timeout 5" -- "hi" --timeout 3
    .venv/bin/python scripts/pair.py 18 --limit 600 --server-args="--tokens 16384" -- --tokens 16384

The library under it is common/chapter_pair.py (run_pair), which the tour, the benchmark
scripts and the tests call.
"""
import shlex
import signal
import sys

from common import cli, usage
from common.chapter_pair import run_pair


class Signalled(BaseException):
    """SIGTERM, as KeyboardInterrupt is SIGINT: run_pair stops both sides on either."""


def _terminated(signum, _):
    raise Signalled(signum)


def main():
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("chapter", help="chapter number, e.g. 04")
    p.add_argument("-p", "--provider")
    p.add_argument("--clients", type=int, default=1, help="how many clients to run in turn")
    p.add_argument("--server-args", default="", help="extra server arguments, one string")
    p.add_argument("--limit", type=usage.positive(float, "a number of seconds"), default=60.0,
                   metavar="S",
                   help="seconds the server may take to print its address and each client "
                        "to run (default 60; stretched when the machine is busy)")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.client_args = argv[split + 1:]  # everything after -- goes to the client
    signal.signal(signal.SIGTERM, _terminated)
    try:
        pair = run_pair(args.chapter, args.provider, shlex.split(args.server_args),
                        [args.client_args] * args.clients, timeout=args.limit,
                        echo=(sys.stdout, sys.stderr))
    except FileNotFoundError as e:
        sys.exit(f"pair: {e}")
    except (KeyboardInterrupt, Signalled) as e:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # said once, whatever comes next
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        how = "interrupted" if isinstance(e, KeyboardInterrupt) else "got SIGTERM"
        print(f"pair: {how}; server and clients stopped", file=sys.stderr, flush=True)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    for name, run in [("server", pair.server)] + [(f"client {i + 1}", c)
                                                    for i, c in enumerate(pair.clients)]:
        program, *args = run.args[1:]  # after the interpreter
        print(f"--- {name}: {shlex.join([cli.shown(program), *args])} -> exit {run.rc}")
    if not pair.clients:
        print("--- no client ran: the server printed no address")
    return 0 if pair.ok else 1


if __name__ == "__main__":
    sys.exit(main())

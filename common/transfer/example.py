"""Two processes and the transfer engine: the least a program needs (README.md beside it).

The reader registers memory and starts the writer, handing it its engine's address and
its region's descriptor (bytes; here as hex on the writer's command line). The writer
connects, SENDs its own address back as a control message, and writes every page into
the reader's memory in reverse order, each WRITE with immediate IMM; the reader's
expect(IMM, PAGES) returns once all have arrived. Only then does the reader connect, to
the address that came, and SEND its verdict, which the writer prints.

Neither side waits for the other to connect: connect() only records an address, so
either may connect first, and WRITEs and messages from an engine not connected still
arrive (recv() names no peer for them). Every wait is bounded by the engine's timeout.

    .venv/bin/python -m common.transfer.example              # shm
    .venv/bin/python -m common.transfer.example -p tcp
"""
import subprocess
import sys

import numpy as np

import common.fabric as fi
from common import cli
from common.transfer import Engine

PAGES, PAGE, IMM = 64, 4096, 7


def pages():
    """What the writer sends: PAGES pages of PAGE bytes, page i filled with i."""
    return np.repeat(np.arange(PAGES, dtype=np.uint8), PAGE).reshape(PAGES, PAGE)


def reader(args):
    with fi.Closer() as own:
        eng = Engine(own, provider=args.provider, timeout=args.timeout)
        into = np.zeros((PAGES, PAGE), np.uint8)  # any dtype: offsets and sizes are bytes
        region = eng.register(into)
        writer = subprocess.Popen([sys.executable, "-m", "common.transfer.example",
                                   "-p", eng.name, "--timeout", str(args.timeout), "--writer",
                                   eng.address().hex(), region.descriptor().hex()])
        own.callback(end, writer, args.timeout)  # ended, should we fail first
        sender, address = eng.recv()  # the writer's address; no Peer yet: None
        eng.expect(IMM, PAGES)  # every page's WRITE arrived (each carries IMM)
        wrong = int(np.count_nonzero(into != pages()[::-1]))
        peer = eng.connect(address)  # not needed to take WRITEs: needed to send
        eng.send(peer, f"{PAGES} pages arrived, {wrong} wrong bytes".encode())
        code = writer.wait(args.timeout)
    print(f"reader: {PAGES} pages, {wrong} wrong bytes; the writer's first message came "
          f"from peer {sender}, as none was connected; writer exit {code}")
    return 1 if wrong or code else 0


def writer(args):
    address, descriptor = bytes.fromhex(args.writer[0]), bytes.fromhex(args.writer[1])
    with fi.Closer() as own:
        eng = Engine(own, provider=args.provider, timeout=args.timeout)
        peer = eng.connect(address)
        eng.send(peer, eng.address())  # so that the reader can connect back
        dst = eng.remote(descriptor)
        src = eng.register(pages())
        eng.write_pages(peer, src, range(PAGES), dst, range(PAGES)[::-1], PAGE,
                        imm=IMM).wait()  # done here: posted and completed, not yet counted there
        _, verdict = eng.recv()
    print(f"writer: the reader says: {verdict.decode()}", flush=True)


def end(child, timeout):
    """Stop `child` if it still runs, within `timeout` s and a kill."""
    if child.poll() is None:
        child.terminate()
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def main():
    p = cli.parser(__doc__)
    p.add_argument("--writer", nargs=2, metavar=("ADDRESS", "DESCRIPTOR"),
                   help="be the writer (the reader starts it so)")
    args = p.parse_args()
    args.provider = args.provider or "shm"
    return writer(args) if args.writer else reader(args)


if __name__ == "__main__":
    cli.run(main)

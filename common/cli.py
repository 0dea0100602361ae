"""Command-line conventions shared by every chapter.

Same flag, same meaning, everywhere; bad input is one line on stderr and a
non-zero exit, never a traceback.
"""
import argparse
import math
import os
import re
import shlex
import sys

import common.fabric as fi
from common import bounds, shm_files
from common.fabric import FabricError
from common.patience import STRETCH, stretched  # noqa: F401 (cli.STRETCH, for the tests)
from common.records import parse_label  # noqa: F401 (an argparse type: cli.parse_label)
from common.usage import UsageError, interrupted  # also cli.UsageError, cli.interrupted
from common.usage import parse_size  # noqa: F401 (the chapters' cli.parse_size)

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
CACHE_LINE = 64  # bytes: a CPU cache line on x86 and on Arm's Neoverse (Grace)
PEER_TIMEOUT = 10.0  # seconds a chapter waits for its peer before giving up


SIDES = ("Flags marked 'client:' travel in the client's CONNECT and 'server:' ones steer the "
         "server only: each side refuses the other's. The rest mean the same on both sides.")
_UNSET = object()  # a flag's value before parsing: still there afterwards, the flag was not given


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; we want one line
        raise UsageError(message)

    def parse_args(self, args=None, namespace=None):
        """Flags anywhere, also after the positionals (`ADDRESS -p shm "hi"`), as people type
        them; a flag of the other side (see side()) refused in one line. A program about to
        run (its flags good) first removes what killed processes left in /dev/shm."""
        sided = [a for a in self._actions if getattr(a, "side", None)]
        given = argparse.Namespace(**{a.dest: _UNSET for a in sided})
        parsed = self.parse_intermixed_args(args, namespace or given)
        me = "server" if getattr(parsed, "address", None) is None else "client"
        wrong = [a.option_strings[-1] for a in sided
                 if getattr(parsed, a.dest) is not _UNSET and a.side != me]
        for a in sided:
            if getattr(parsed, a.dest) is _UNSET:
                setattr(parsed, a.dest, a.default)
        # this side's own flags, as a record keeps them (common/records.py: options)
        parsed.own_flags = tuple(a.dest for a in self._actions if a.dest not in ("help", "address")
                                 and getattr(a, "side", me) == me)
        if wrong:
            other, one = "client" if me == "server" else "server", len(wrong) == 1
            why = " (it sends the values in its CONNECT)" if other == "client" else ""
            raise UsageError(f"{', '.join(wrong)}: {'a flag' if one else 'flags'} of the "
                             f"{other}{why}, not of the {me}: give {'it' if one else 'them'} "
                             f"to the {other}")
        if removed := shm_files.sweep():
            print(f"removed from /dev/shm, left by processes that ended: {' '.join(removed)}")
        return parsed


def side(who, *actions):
    """Mark flags (what add_argument returned) as read by one side only, "client" or
    "server": --help says so, and the other side refuses them instead of ignoring them."""
    for action in actions:
        action.side = who
        action.help = f"{who}: {action.help}"


def command(*args, program=None):
    """The command that runs this program (or `program`) with `args`, as it works pasted
    into a plain shell here: this interpreter (a venv's, not whatever `python` is on PATH)
    and the program, relative to the current folder when they are inside it."""
    def runnable(path):  # "x" alone would be looked up on PATH
        path = shown(path)
        return path if os.sep in path else os.path.join(os.curdir, path)
    return shlex.join([runnable(sys.executable), runnable(program or sys.argv[0]),
                       *map(str, args)])


def shown(path):
    """A path as the reader can use it from here: relative to the current folder when it is
    inside it, else absolute."""
    path = os.path.abspath(path)  # not realpath: a venv's python is a symlink
    rel = os.path.relpath(path)
    return path if rel.startswith(os.pardir) else rel


def parser(doc, **kw):
    """An ArgumentParser whose description is the first paragraph of the chapter's docstring."""
    p = Parser(description=doc.strip().split("\n\n")[0], **kw)
    p.add_argument("-p", "--provider", help="libfabric provider (efa, verbs, shm, tcp, ...) or "
                   "efa's fabric efa-direct; default: the first of efa, verbs, shm, tcp usable "
                   "here")
    p.add_argument("--timeout", type=seconds, default=peer_timeout(),
                   help="seconds to wait for the peer (default %(default).3g): a peer "
                   "silent that long is taken for gone; 0: the peer must answer at once "
                   "(a wait that finds nothing at its first look gives up)")
    return p


def peer_timeout():
    """The default --timeout: PEER_TIMEOUT, stretched by the load only where STRETCH is set."""
    return stretched(PEER_TIMEOUT)


def add_peer(p):
    """The positional argument that makes a chapter a client: the server's address."""
    p.add_argument("address", nargs="?", help="server address (hex); omit to be the server")
    p.epilog = SIDES


def pick_provider(args, caps=fi.lib.FI_MSG, hmem=False, shm=True):
    """fi_getinfo for -p (or the default), said in one line; the first entry is the best.
    `hmem`: the run's buffers are GPU memory. `shm` False: a benchmark, whose
    endpoints keep efa off its shm path (fi.forbid_shm): said too."""
    info, why = fi.pick(args.provider, caps, hmem)
    args.provider_used = fi.name_of(info)  # for commands we print
    print(f"provider: {fi.provider_of(info)} ({why}), fabric {fi.string(info.fabric_attr.name)}, "
          f"domain {fi.string(info.domain_attr.name)}")
    if not shm and args.provider_used == "efa":
        print(fi.SHM_OFF)
    return info


def peer(args, caps=fi.lib.FI_MSG, hmem=False, shm=True):
    """(fi_info, server address or None): the provider, and the address checked against it."""
    addr = parse_address(args.address) if args.address else None
    info = pick_provider(args, caps, hmem, shm)
    if addr is not None:
        fi.check_address(info, addr)
    return info, addr


def client_hint(args, addr, lesson=None, extra=()):
    """What a server prints for its client: a command to paste, running the client of the
    chapter's LESSON (the run that shows its lesson) against this server."""
    flags = shlex.split(lesson.get("client", "")) if lesson else []
    if "--gpus" in extra and "--groups" in flags:  # GPUs given: they set the groups
        at = flags.index("--groups")
        del flags[at:at + 2]
    return f"run the client: {command('-p', args.provider_used, addr, *flags, *extra)}"


def parse_address(text):
    """A peer address as printed by a server: hex digits, any case. An error names the
    first thing wrong: where a digit is not hex, or the half byte at the end (a length
    wrong for the provider is fabric.check_address's to say)."""
    if not text:
        raise UsageError("address is empty: give the hex digits the server printed")
    bad = re.search(r"[^0-9a-fA-F]", text)
    if bad:
        raise UsageError(f"address: not a hex digit at position {bad.start()}: "
                         f"{bad[0]!r} (in '{text[:40]}')")
    if len(text) % 2:
        raise UsageError(f"address: an odd number of hex digits ({len(text)}): half a byte "
                         "at the end; copy the whole address the server printed")
    return bytes.fromhex(text)


def seconds(text):
    """An argparse type: a finite number of seconds, 0 or more (nan would never end a wait:
    every comparison with it is false)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected seconds, 0 or more, not '{text}'")
    return value


def count(lo, hi=None):
    """An argparse type: a whole number in lo..hi (no upper bound: hi None)."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            expected = f"{lo}..{hi}" if hi is not None else f"{lo} or more"
            raise argparse.ArgumentTypeError(f"expected a number {expected}, not '{text}'")
        return value
    return parse


def add_pages(p, pages, buffer_size, gpu=True):
    """The flags of the chapters that WRITE pages into a client's buffers (06 on)."""
    size = f"{buffer_size >> 20}M" if buffer_size < 1 << 30 else f"{buffer_size >> 30}G"
    side("client",
         p.add_argument("--page-size", type=parse_size, default=64 << 10,
                        help="bytes per page (default 64K), 1 up to --buffer-size: one WRITE "
                        "per page, so at most the NIC's largest message. Any size is "
                        "checked to the byte; a multiple of 64 (a cache line) is what a "
                        "real NIC writes fast"),
         p.add_argument("--pages", help=f"pages to fill, e.g. 0,3,5-9 (default: {pages})"),
         p.add_argument("--buffers", type=int, default=2, help="buffers (default 2)"),
         p.add_argument("--buffer-size", type=parse_size, default=buffer_size,
                        help=f"bytes per buffer (default {size})"),
         p.add_argument("--seed", type=count(0, (1 << 64) - 1), default=42,  # a uint64 in CONNECT
                        help="what the pages are filled from"))
    if gpu:
        p.add_argument("--gpu", type=int, help="this side's memory on this GPU: the client's "
                       "buffers, the server's pages")
    add_clients(p)


def add_engine(p):
    """The transfer engine's flags, alike in chapters 18 and 19 and scripts/transfer_bench.py."""
    p.add_argument("--nics", type=count(1, 64), help="virtual NICs where none has a PCI "
                   "address (default 1)")
    p.add_argument("--no-cuda-ipc", action="store_true", help="GPU memory by libfabric even "
                   "between ranks of this host (by default CUDA IPC: common/transfer/ipc.py)")


def add_clients(p):
    side("server", p.add_argument("--clients", type=count(0), default=0,
                                  help="exit after this many clients (default: serve until "
                                  "Ctrl-C)"))


def check_pages(args, default):
    """Sizes and pages that fit the buffers; `default(pages per buffer)` when no --pages."""
    if args.page_size <= 0 or args.buffer_size < args.page_size or args.buffers < 1:
        raise UsageError(f"need 0 < page size ({args.page_size}) <= buffer size "
                         f"({args.buffer_size}) and at least one buffer")
    if args.page_size % CACHE_LINE and getattr(args, "address", None) is not None:
        # Only the client's pages are laid out by it: the server's line would be noise.
        print(f"note: page size {args.page_size} is not a multiple of {CACHE_LINE} bytes (a "
              "cache line): pages then share lines, and a NIC's DMA into part of a line "
              "costs the host a read-modify-write of it: correct, slower on a real NIC")
    per_buffer = args.buffer_size // args.page_size
    args.pages = parse_pages(args.pages) if args.pages is not None else default(per_buffer)
    if not args.pages or max(args.pages) >= args.buffers * per_buffer:
        raise UsageError(f"--pages must name pages 0..{args.buffers * per_buffer - 1} "
                         f"({args.buffers} buffers x {per_buffer})")


def parse_pages(text):
    """'0,3,5-9' -> [0, 3, 5, 6, 7, 8, 9]"""
    pages = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UsageError(f"--pages: '{part}' is not a page number or range like 5-9")
        if hi and int(hi) < int(lo):
            raise UsageError(f"--pages: '{part}' is reversed: write {hi}-{lo}")
        pages.extend(range(int(lo), int(hi or lo) + 1))
    return pages


def run(main):
    """Run a chapter's main(), turning every expected failure into one line and an exit code,
    each within its bound (common/bounds.py: the watchdog ends what cannot end itself)."""
    name = os.path.basename(sys.argv[0])
    try:
        try:
            bounds.watch()
            if why := fi.prefix_mismatch():
                raise UsageError(why)
            code = main()
        except SystemExit as e:  # sys.exit(...) in main(): the same way out as a return
            code = e.code
        except BrokenPipeError:  # piped into `head`: the reader has what it wanted
            os._exit(0)
        except Exception as e:
            # an interrupt that cut into code whose clean-up then failed is still the
            # interrupt (argparse's, once: an AttributeError from its `finally`)
            if interrupted(e):
                raise KeyboardInterrupt from e
            if isinstance(e, UsageError):
                _last_words(f"{name}: error: {e}", EXIT_USAGE)
            if isinstance(e, (FabricError, TimeoutError, ValueError, ConnectionError)):
                _last_words(f"{name}: error: {e}", EXIT_ERROR)
            raise  # a bug: its traceback
    except KeyboardInterrupt:  # also one that cut in while an error above was being said
        _last_words(f"{name}: interrupted, resources closed",
                    bounds.exit_code(EXIT_INTERRUPTED))
    _leave(code)


def _last_words(line, code):
    """Say `line` and exit with `code`, deaf to Ctrl-C from here on: a launcher that stops its
    ranks sends one right behind its message, and it must not cut the line short."""
    fi.stop_interrupting()
    bounds.say(line + "\n")
    _leave(code)


def _leave(code):
    """End the process with `code` (sys.exit's kinds: None, a number, a message) once main()
    has closed what it opened, deaf to signals, and without Python's finalization: a
    SIGTERM there (a launcher stopping ranks that have just finished) printed a traceback
    from threading's shutdown, or, once the signal module had put the default action
    back, killed the process (-15) after its work was done."""
    fi.stop_interrupting()
    if isinstance(code, str):
        bounds.say(code + "\n")
    bounds.leave(1 if isinstance(code, str) else code or 0)

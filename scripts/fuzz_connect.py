"""Lies at a chapter's server: seeded CONNECTs and control messages that are wrong, sent at the
real server, which must say one line about each and then serve an honest client.

For each chapter and provider it starts the chapter's server (--timeout 2, serving any
number of clients), opens one endpoint of its own on the same provider and sends lies built
from the chapter's own formats (the structs of the chapter and of common/fabric/connect.py,
imported, never written again): a CONNECT truncated or padded, every field at 0 or at its
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
import random
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
from common.chapter_pair import (ADDRESS, ROOT, _Collector, chapter_module, chapter_path,
                                 local_env, stop)
from common.engine import multinet
from common.fabric import connect, ffi, lib, memory
from common.launch import owned
from common.patience import patience
from common.transfer import wire

CHAPTERS = ("05", "06", "07", "09", "10", "11", "12", "13", "14", "15", "18")
PROVIDERS = ("shm", "tcp")
TIMEOUT = 2.0     # the server's --timeout
SETTLE = 0.3      # seconds after a lie's last line during which no other may come
WRONG = re.compile(r"\b[1-9]\d* wrong bytes")
PAGE, BUFFER, PAGES = 4096, 1 << 20, list(range(16))  # a plausible CONNECT's geometry
ROOM = 4 * BUFFER  # bytes registered per buffer: a lie claiming more than BUFFER stays in it
ITERS = 64         # WRITEs a plausible CONNECT asks for
RING = 8           # receives kept posted for the server's answers
TOKENS = "256"     # chapter 18's prompt, both sides
KV_TIMEOUT = 5.0   # chapter 18's decoder's --timeout (server_args)
# Addresses no process maps (non-canonical on x86-64 and arm64): a WRITE there fails
NOWHERE = (0x8000_0000_0000_0000, 0xDEAD_0000_0000_0000)


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


# --- the lies -------------------------------------------------------------------------

@dataclass
class Me:
    """What a lie may tell the truth about: our address, our provider (fabric.name_of: an
    engine's address carries it), our buffers (base, size, key)."""
    address: bytes
    provider: str
    regions: list
    max_send: int
    # A SEND longer than the server's receive: never on shm, whose receiver then spins for
    # good in the provider, a copy of the sender's bytes that can never end once the
    # receive is full (1.17: smr_cma_loop, prov/shm/src/smr.h; 2.6: cma_copy,
    # include/ofi_cma.h, from smr_progress_iov): no server can refuse it
    oversize: bool = True


@dataclass
class Lie:
    number: int
    chapter: str
    kind: str
    what: str
    messages: list        # bytes, sent in this order
    lines: int = 1        # stderr lines the server owes: one per client it makes up
    may_end: bool = False  # chapter 18's decoder ends on a request that reaches nobody
    may_write: bool = False  # chapter 06 WRITing where no region is: the provider may
    #                          complete them all, and the server say so (its lesson, "Who
    #                          notices a wrong key"): the line is on stdout


class Form:
    """A chapter's CONNECT as fields: preamble, header (struct, values), per-lane names,
    regions, page runs; bytes() packs it with the chapter's own structs."""

    def __init__(self, chapter, me):
        self.chapter, self.number, self.me = chapter, int(chapter), me
        self.address = me.address
        self.header, self.values, self.names = None, [], []
        self.regions = [(base, BUFFER, key) for base, _, key in me.regions]
        self.runs, self.tail = [(0, len(PAGES))], b""
        seed = 7
        if chapter == "06":
            m = module(6)
            self.header, self.values = m.HEADER, [seed, PAGE, 1, 2]
        elif chapter == "07":
            m = module(7)
            self.header, self.values = m.HEADER, [seed, PAGE, ITERS, 1, 2, False]
        elif chapter != "05":
            self.header, self.values = multinet.HEADER, [seed, PAGE, ITERS, 1, 2, 1, 1]
            self.names = [me.address]
        self.runs_at = 3 if chapter != "06" else 2   # index of the runs count
        self.nbufs_at = self.runs_at + 1

    def body(self):
        if self.header is None:
            return self.tail
        return (self.header.pack(*self.values) + multinet.pack_names(self.names)
                + b"".join(multinet.REGION.pack(*r) for r in self.regions)
                + b"".join(connect.RUN.pack(*r) for r in self.runs) + self.tail)

    def bytes(self, chapter=None):
        return connect.pack(self.number if chapter is None else chapter, self.address,
                            self.body())


def module(number, _cache={}):
    if number not in _cache:
        _cache[number] = chapter_module(number)
    return _cache[number]


def field_bits(fmt):
    """The width in bits of each field of a struct (its format letters)."""
    sizes = {"B": 8, "H": 16, "I": 32, "Q": 64, "?": 8}
    return [sizes[c] for c in fmt.format if c in sizes]


def largest(bits):
    return (1 << bits) - 1


def packable(fmt, values):
    """`values` fit for fmt.pack: a bool field takes any int, but packs only 0 or 1."""
    return [bool(v) if c == "?" else v for c, v in zip(fmt.format[1:], values)]


# Each kind: (rng, form) -> (what, messages, lines); None where it makes no sense here.
def truncated(rng, form):
    whole = form.bytes()
    cut = rng.randrange(0, len(whole))
    return f"cut to {cut} of {len(whole)} bytes", [whole[:cut]], 1


def padded(rng, form):
    whole = form.bytes()
    if form.me.oversize and rng.random() < 0.3:  # more than the server's receive holds
        extra = form.me.max_send + 1 - len(whole) + rng.randrange(0, form.me.max_send)
        return f"padded to {len(whole) + extra} bytes, past one SEND", \
            [whole + rng.randbytes(extra)], 1
    extra = rng.randrange(1, 65)
    return f"{extra} bytes after its end", [whole + rng.randbytes(extra)], 1


def zero(rng, form):
    if form.header is None:
        return "an address of 0 bytes", [connect.PREAMBLE.pack(connect.MAGIC, form.number, 0)], 1
    form.values = [0] * len(form.values)
    return "every header field 0", [form.bytes()], 1


def at_largest(rng, form):
    if form.header is None:
        form.address = rng.randbytes(rng.randrange(0, form.me.max_send - connect.PREAMBLE.size))
        return f"an address of {len(form.address)} bytes", [form.bytes()], 1
    form.values = [largest(b) for b in field_bits(form.header)]
    form.values = packable(form.header, form.values)
    return "every header field at its largest", [form.bytes()], 1


def negative(rng, form):
    if form.header is None:
        return None
    # any field but the seed (field 0), which every value is good for
    i = rng.choice([i for i, c in enumerate(form.header.format[1:]) if c != "?" and i])
    form.values[i] = largest(field_bits(form.header)[i]) + 1 - rng.choice([1, 2, PAGE])
    return f"header field {i} = {form.values[i]:#x} (negative)", [form.bytes()], 1


def small_buffers(rng, form):
    if form.header is None:
        return None
    size = rng.randrange(0, PAGE)
    form.regions = [(b, size, k) for b, _, k in form.regions]
    return f"buffers of {size} bytes, pages of {PAGE}", [form.bytes()], 1


def pages_past(rng, form):
    if form.header is None:
        return None
    first = len(form.regions) * (BUFFER // PAGE) + rng.randrange(0, 1 << 20)
    form.runs = [(0, 4), (first, rng.randrange(1, 8))]
    form.values[form.runs_at] = 2
    return f"page {first} of {len(form.regions)} buffers", [form.bytes()], 1


def counts(rng, form):
    """A count larger than what follows: runs or buffers (or lanes), up to the largest."""
    if form.header is None:
        return None
    at = rng.choice([i for i in range(form.runs_at, len(form.values))
                     if form.header.format[i + 1] != "?"])
    form.values[at] = rng.choice([largest(field_bits(form.header)[at]),
                                  form.values[at] + rng.randrange(1, 100)])
    return f"header field {at} = {form.values[at]} (more than follow)", [form.bytes()], 1


def unequal(rng, form):
    if form.header is None:
        return None
    (b0, s0, k0), (b1, _, k1) = form.regions[:2]
    form.regions[1] = (b1, rng.randrange(PAGE, s0), k1)
    form.runs = [(0, 2 * (BUFFER // PAGE))]  # pages of both buffers
    return "buffers of unequal sizes", [form.bytes()], 1


def no_region(rng, form):
    if form.header is None:
        return None
    form.regions = [(b, s, rng.randrange(1 << 32) | 1 << 40) for b, s, _ in form.regions]
    return "keys of no region", [form.bytes()], 1


def nowhere(rng, form):
    if form.header is None:
        return None
    where = rng.choice(NOWHERE) + PAGE * rng.randrange(1 << 16)
    form.regions = [(where, s, k) for _, s, k in form.regions]
    return f"buffers at {where:#x}, mapped by nobody", [form.bytes()], 1


def nobody(rng, form):
    """An address of nobody: of our address's length (a process that is not there), or any."""
    me = form.me.address
    if me.startswith(fi.SHM_PREFIX) and rng.random() < 0.5:
        form.address = fi.SHM_PREFIX + f"{rng.randrange(1 << 22)}:0:0".encode() + b"\0"
    elif rng.random() < 0.5:
        form.address = rng.randbytes(len(me))
    else:
        form.address = rng.randbytes(rng.randrange(0, 2 * connect.ADDRESS_BOUND))
    return f"the address of nobody ({form.address[:24]!r})", [form.bytes()], 1


def other_chapter(rng, form):
    chapter = rng.choice([c for c in range(256) if c != form.number])
    return f"chapter {chapter}'s CONNECT", [form.bytes(chapter)], 1


def repeated(rng, form):
    what, messages, lines = rng.choice([truncated, at_largest, other_chapter, zero])(rng, form)
    return f"twice: {what}", messages * 2, 2 * lines


def stray(rng, form):
    """A message that is no CONNECT: a control message out of turn, a text, noise."""
    message = rng.choice([module(7).LANDED.pack(rng.randrange(1 << 64)), multinet.INSERTED,
                          b"T" + b"olleh", b"", connect.MAGIC, rng.randbytes(rng.randrange(1, 64)),
                          connect.REFUSED + b"by a client"])
    if message.startswith(connect.MAGIC) and len(message) >= connect.PREAMBLE.size:
        message = b"X" + message
    return f"{len(message)} bytes that are no CONNECT: {message[:12]!r}", [message], 1


def mid_run(rng, form):
    """A plausible CONNECT (our own buffers, right keys), then a control message that lies or
    none: the server owes one line for that client, one more for a message it takes for
    another's CONNECT."""
    landed = module(7).LANDED
    honest = form.bytes()
    noise = rng.randbytes(rng.randrange(1, 40))
    if form.chapter == "05":
        choices = [("no text", [], 1), ("no text, a LANDED", [landed.pack(ITERS)], 2)]
    elif form.chapter == "07":
        choices = [("a LANDED that lies", [landed.pack(rng.choice([0, ITERS + 1, 1 << 63]))], 1),
                   ("no LANDED", [], 1), ("noise for LANDED", [noise], 2)]
    else:
        choices = [("noise for the lanes' word", [noise], 2), ("no word of the lanes", [], 1),
                   ("a LANDED that lies", [multinet.INSERTED, landed.pack(ITERS - 1)], 1),
                   ("the CONNECT again", [honest], 2)]
    what, after, lines = rng.choice(choices)
    return f"a plausible CONNECT, then {what}", [honest, *after], lines


# chapter 18: its request is REQUEST + an engine's address (common/transfer/wire.py)
def engine_address(rng, me, nics=1, control=None, signal=None):
    region = wire.pack_region(0, 0, [0] * nics, [0] * nics, b"")
    return wire.pack_address(rng.randrange(1 << 32), me.provider, control or me.address, b"",
                             [me.address] * nics, region if signal is None else signal)


def kv_request(rng, me, kind):
    request = module(18).REQUEST
    whole = request + engine_address(rng, me)
    if kind == "truncated":
        cut = rng.randrange(0, len(whole))
        return f"cut to {cut} of {len(whole)} bytes", [whole[:cut]], 1, False
    if kind == "padded":
        return "bytes after its end", [whole + rng.randbytes(rng.randrange(1, 64))], 1, False
    if kind == "zero":
        head = wire.ADDRESS.pack(wire.MAGIC_ADDRESS, 0, 0, 0, 0, 0)
        return "every address field 0", [request + head], 1, False
    if kind == "largest":
        head = wire.ADDRESS.pack(wire.MAGIC_ADDRESS, largest(32), largest(16), largest(16),
                                 largest(16), largest(8))
        return "every address field at its largest", [request + head + whole[-40:]], 1, False
    if kind == "counts":
        nics = rng.randrange(2, 9)
        return f"{nics} NICs, the decoder's 1", [request + engine_address(rng, me, nics)], 1, \
            False
    if kind == "nobody":
        nobody_at = rng.randbytes(len(me.address))
        if me.address.startswith(fi.SHM_PREFIX):
            nobody_at = fi.SHM_PREFIX + f"{rng.randrange(1 << 22)}:0:0".encode() + b"\0"
        return "a request from nobody", [request + engine_address(rng, me, control=nobody_at)], \
            1, True
    if kind == "repeated":
        return "a request of 0 fields, twice", [request] * 2, 2, False
    _, messages, lines = stray(rng, None)
    return "a message that is no request", messages, lines, False


KINDS = {"truncated": truncated, "padded": padded, "zero": zero, "largest": at_largest,
         "negative": negative, "small-buffers": small_buffers, "pages-past": pages_past,
         "counts": counts, "unequal": unequal, "no-region": no_region, "nowhere": nowhere,
         "nobody": nobody, "chapter": other_chapter, "repeated": repeated, "stray": stray,
         "mid-run": mid_run}
KV_KINDS = ("truncated", "padded", "zero", "largest", "counts", "nobody", "repeated", "stray")
# Kinds that cost the server its --timeout (it waits for a client that never comes): rarer
SLOW = {"no-region": 1, "mid-run": 1, "nobody": 1}


def kinds(chapter):
    if chapter == "18":
        return list(KV_KINDS)
    if chapter == "05":
        return ["truncated", "padded", "zero", "largest", "nobody", "chapter", "repeated",
                "stray", "mid-run"]
    if chapter == "06":  # nothing follows its CONNECT: a plausible one is served
        return [k for k in KINDS if k != "mid-run"]
    return list(KINDS)


def lie(number, seed, chapter, me, kind=None):
    """Lie `number` of `seed` at `chapter`'s server: the same lie for the same `me`."""
    rng = random.Random(f"{seed}:{chapter}:{number}")
    names = kinds(chapter)
    kind = kind or rng.choices(names, [SLOW.get(k, 3) for k in names])[0]
    if chapter == "18":
        what, messages, lines, may_end = kv_request(rng, me, kind)
        return Lie(number, chapter, kind, what, messages, lines, may_end=may_end)
    what, messages, lines = KINDS[kind](rng, Form(chapter, me))
    return Lie(number, chapter, kind, what, messages, lines,
               may_write=chapter == "06" and kind in ("no-region", "nowhere"))


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

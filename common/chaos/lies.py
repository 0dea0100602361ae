"""The lies of scripts/fuzz_connect.py (and of scripts/chaos.py's lying client): for a
chapter's server, seeded CONNECTs and control messages that are wrong, built from the
chapter's own formats (the structs of the chapter, of common/fabric/connect.py and of
common/transfer/wire.py, imported, never written again). Lie K of a seed, chapter and
`Me` is always the same lie; a Lie says which lines the server owes for it.
"""
import random
from dataclasses import dataclass

import common.fabric as fi
from common.chapter_pair import chapter_module
from common.engine import multinet
from common.fabric import connect
from common.transfer import wire

CHAPTERS = ("05", "06", "07", "09", "10", "11", "12", "13", "14", "15", "18")
PAGE, BUFFER, PAGES = 4096, 1 << 20, list(range(16))  # a plausible CONNECT's geometry
ROOM = 4 * BUFFER  # bytes registered per buffer: a lie claiming more than BUFFER stays in it
ITERS = 64         # WRITEs a plausible CONNECT asks for
TOKENS = "256"     # chapter 18's prompt, both sides
# Addresses no process maps (non-canonical on x86-64 and arm64): a WRITE there fails
NOWHERE = (0x8000_0000_0000_0000, 0xDEAD_0000_0000_0000)


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

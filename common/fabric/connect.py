"""CONNECT, the first message of every client from chapter 05 on, and how a server
answers a client it will not (or can no longer) serve.

CONNECT opens with what a server of any chapter can read: a magic, the client's
chapter and its address. So a server never misreads a request of another
chapter's format: it tells that client why (a refusal, which the client waits
for like any reply) and serves the next one. Every control message, CONNECT
included, fits in one SEND the NIC carries whole (fabric.max_send): page lists
travel as runs of consecutive pages, which keeps the series' 1000 pages per
buffer to 8 bytes each. A client that goes away mid-run is reported as gone,
in one line, and the server serves the next.
"""
import errno
import os
import struct
import sys

from common import shm_files, usage
import common.fabric as fi
from common.fabric import ffi, lib

MAGIC = b"LFtu"                    # "libfabric tutorial"
PREAMBLE = struct.Struct("<4sBH")  # magic, the client's chapter, its address length
RUN = struct.Struct("<II")         # a run of pages: the first, how many
REFUSED = b"refused: "  # server -> client, then why; never a heartbeat's length
WHY = 240  # bytes of the why that reach the client: a refusal, like a heartbeat or LANDED
#            (8 bytes), is below any link's MTU (InfiniBand's smallest is 256)
ADDRESS_BOUND = 64  # bytes: no provider's address is longer (efa 32, verbs 28 or 48)
# How providers report an operation to a peer that is no longer there: shm the failed
# copy into a dead process (EIO), tcp;ofi_rxm the cancelled operations of a closed
# connection, efa an unreachable or unresponsive peer (prov/efa/src/efa_errno.h).
PEER_GONE = {"EIO", "ECANCELED", "ECONNABORTED", "ECONNRESET", "ENOTCONN", "EHOSTUNREACH",
             "EPIPE"}
HELD_MAX = 8  # failed clients with WRITEs still out that one endpoint keeps (AV: 16 places)


class Refused(ValueError):
    """A CONNECT this server does not serve; the client has been told why when it could be."""


def pack(chapter, address, body):
    return PREAMBLE.pack(MAGIC, chapter, len(address)) + address + body


def next_request(poller, inbox):
    """The next message in `inbox` (an fi.Inbox), waited for as long as it takes. One longer
    than the inbox fails its receive (FI_ETRUNC: a client that ignores fabric.max_send):
    said in one line, and the wait goes on. Except on shm, where one longer than its inject
    size (4 KiB, SMR_INJECT_SIZE) never completes: the provider copies from the sender until
    the sender's length is done, and once the receive's buffer is full each copy moves 0
    bytes, forever (cma_copy, include/ofi_cma.h in 2.1 and 2.6; smr_cma_loop,
    prov/shm/src/smr.h in 1.17). The server then spins inside fi_cq_read, and only a signal
    ends it (the watchdog, common/bounds.py): no receiver can refuse such a SEND, so on shm
    a peer is trusted not to send more than its receiver posted."""
    while True:
        try:
            _, length = poller.wait([inbox.ctx], None, "CONNECT", idle=True)
            return inbox.take(length)
        except fi.CompletionError as e:
            if fi.key(e.context) != fi.key(inbox.ctx) or not too_long(e, inbox.size):
                raise
            inbox.post()


def too_long(error, size):
    """Whether `error` is a receive of `size` bytes failed by a longer message (FI_ETRUNC);
    if so, said in one line."""
    if abs(error.rc) != lib.FI_ETRUNC:
        return False
    print(f"ignored a message longer than {size} bytes (one SEND here)", file=sys.stderr,
          flush=True)
    return True


def is_connect(message):
    return message[:len(MAGIC)] == MAGIC and len(message) >= PREAMBLE.size


def stray(message):
    """Whether `message`, which came where a CONNECT was due, is something else (a chapter
    04 client's text, another program's): said in one line, it is not a client."""
    if is_connect(message):
        return False
    print(f"ignored a {len(message)}-byte message that is not a CONNECT", file=sys.stderr,
          flush=True)
    return True


def unpack(message, chapter):
    """(the client's address, the rest, why not) of a CONNECT to `chapter`'s server:
    `why not` is None, or says that the client is of another chapter."""
    _, theirs, length = unpack_from(PREAMBLE, message)
    at = PREAMBLE.size + length
    if at > len(message):
        raise ValueError(f"CONNECT is {at - len(message)} bytes short of the address it "
                         f"announces ({length} bytes)")
    why = (None if theirs == chapter else
           f"this is chapter {chapter:02d}'s server; you ran chapter {theirs:02d}'s client")
    return message[PREAMBLE.size:at], message[at:], why


def accept(own, info, av, domain, ep, poller, request, chapter, timeout, busy=lambda: 0):
    """(the client's fi_addr, the rest of its CONNECT), for a client of `chapter`, its
    address checked for `info`'s provider before it goes into the AV (fi.av_insert);
    one of another chapter is told so by name and refused (Refused). `busy` says, when
    `own` lets the client go, how many of our operations to it still wait for its answer
    (OpQueue.awaiting_answers): while any does, its address stays in the AV (let_go)."""
    address, body, why = unpack(request, chapter)
    client = fi.av_insert(av, address, info)
    own.callback(let_go, av, client, busy)
    if why:
        refuse(own, domain, ep, poller, client, why, timeout)
        raise Refused(why)
    return client, body


def let_go(av, client, busy):
    """Remove a client from the AV, unless operations to it still wait for its answer:
    then the server must close its endpoint (renew it) instead. shm's fi_av_remove unmaps the
    peer's region (smr_map_del, prov/shm/src/smr_util.c), and a WRITE with
    FI_DELIVERY_COMPLETE still waits for the peer's answer: when a stopped client is
    continued and answers, the server's progress (smr_progress_resp_entry,
    smr_progress.c) reads that peer's region through the AV's map. 1.17 leaves the
    pointer to the unmapped region there (SIGSEGV in pthread_spin_trylock); 2.1 sets it
    to NULL, which its SAR and inject answers then dereference. Closing the endpoint
    discards what is still posted (man/fi_endpoint.3.md, fi_close), and no progress
    runs on it after."""
    if not busy():
        fi.av_remove(av, client)


def refusal(why):
    return REFUSED + str(why).encode()[:WHY]


def refuse(own, domain, ep, poller, client, why, timeout):
    """Tell a client that waits for the server why nothing more will come. If it cannot
    hear it (gone too), the server's own line still says why."""
    try:
        poller.send(own, domain, ep, refusal(why), client, 1003, timeout, "the refusal")
    except (fi.FabricError, TimeoutError):
        pass


def heard(message):
    """A message from the server, unless it is a refusal: then ValueError with its why."""
    if message.startswith(REFUSED):
        raise ValueError("the server " + message.decode(errors="replace"))
    return message


def check_landed(said, iters):
    """Refuse (ValueError) a LANDED that does not confirm the `iters` WRITEs written: the
    client passes on the immediate data it got, so any other count is a lie or a loss."""
    if said != iters:
        raise ValueError(f"the client says {said} WRITEs landed, of {iters}")


def fits(info, size, too_many):
    """Refuse (usage.UsageError, saying what is `too_many`) a CONNECT of `size` bytes that
    one SEND on `info`'s NIC would not carry whole."""
    limit = fi.max_send(info)
    if size > limit:
        raise usage.UsageError(f"too many {too_many}: CONNECT would be {size} bytes, and one "
                               f"SEND on this NIC carries at most {limit} (fabric.max_send)")


def pack_pages(pages):
    """The page list as runs of consecutive pages: (first, count) each."""
    runs = []
    for page in pages:
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1][1] += 1
        else:
            runs.append([page, 1])
    return len(runs), b"".join(RUN.pack(*run) for run in runs)


def pages_flag(pages):
    """The page list as --pages writes it: "0-63,70"."""
    runs = []
    for page in pages:
        if runs and runs[-1][1] + 1 == page:
            runs[-1][1] = page
        else:
            runs.append([page, page])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def unpack_pages(data, at, runs, page_size):
    """The pages of `runs` runs packed by pack_pages from `at` on, which end the CONNECT.
    Every count is a client's: the message's length is checked against them before a
    run is read, and the pages of `page_size` bytes against this host's memory before
    the list is built (a server generates them all: memory.seeded_source)."""
    end = at + runs * RUN.size
    if end != len(data):
        raise ValueError(f"CONNECT is {len(data)} bytes; its {runs} page runs make it {end}")
    counted = [unpack_from(RUN, data, at + i * RUN.size) for i in range(runs)]
    total = sum(count for _, count in counted)
    if total * max(page_size, PAGE_COST) > source_bound():
        raise ValueError(f"CONNECT asks for {total} pages of {page_size} bytes: more than "
                         f"half this host's memory")
    return [p for first, count in counted for p in range(first, first + count)]


PAGE_COST = 64  # bytes a server holds per page asked for, however small the page


def source_bound():
    """The most bytes of pages a server generates for one client: half its memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def unpack_from(fmt, data, at=0):
    """`fmt`'s fields at `at` of a client's message; one that ends before them is a
    ValueError that says by how much (a client's bytes are never trusted: struct.error
    would be a traceback)."""
    if len(data) < at + fmt.size:
        raise ValueError(f"CONNECT is {at + fmt.size - len(data)} bytes short of its format")
    return fmt.unpack_from(data, at)


def check_targets(regions, page_size, pages):
    """Refuse (ValueError) a CONNECT whose buffers (`regions`: remote address, size, key)
    no WRITE of a page of `page_size` could reach, or whose `pages` lie past them: every
    buffer holds the first one's whole pages, and page p is in buffer p // that many."""
    if not regions:
        raise ValueError("CONNECT names no buffers")
    if page_size <= 0:
        raise ValueError(f"CONNECT asks for page size {page_size}")
    size = regions[0][1]
    if size < page_size:
        raise ValueError(f"CONNECT claims buffers of {size} bytes, smaller than its page "
                         f"size ({page_size})")
    per_buffer = size // page_size
    if any(r[1] < size for r in regions):
        raise ValueError("CONNECT claims buffers of unequal sizes")
    if not pages:
        raise ValueError("CONNECT asks for no pages")
    last = max(pages)
    if last >= len(regions) * per_buffer:
        raise ValueError(f"CONNECT asks for page {last} of {len(regions)} "
                         f"buffer{'s' if len(regions) > 1 else ''} of {per_buffer} "
                         f"page{'s' if per_buffer > 1 else ''}")
    return per_buffer


def write_messages(source, page_size, pages, which, regions, desc, dest):
    """The fi_msg_rma of each WRITE, built once (posting then only sets a context):
    for j in `which`, slot j of `source` to page pages[j] of the peer's buffers,
    `regions` being their (remote address, size, key). Returns (messages, what
    they point to): keep the second alive as long as the first."""
    per_buffer = regions[0][1] // page_size
    n = len(which)
    keep = (ffi.new("struct iovec[]", n), ffi.new("struct fi_rma_iov[]", n),
            ffi.new("void *[1]", [desc]), ffi.new("struct fi_msg_rma[]", n))
    iovs, rmas, descs, messages = keep
    for i, j in enumerate(which):
        base, _, key = regions[pages[j] // per_buffer]
        iovs[i] = {"iov_base": ffi.cast("void *", source.ptr + j * page_size),
                   "iov_len": page_size}
        rmas[i] = {"addr": base + (pages[j] % per_buffer) * page_size, "len": page_size,
                   "key": key}
        messages[i] = {"msg_iov": iovs + i, "desc": descs, "iov_count": 1, "addr": dest,
                       "rma_iov": rmas + i, "rma_iov_count": 1}
    return [messages + i for i in range(n)], keep


def verified(checked, asked, total, iters, page_size, wrong):
    """The client's line on its check: `checked` pages of the `total` it asked for (`asked`
    names them, "64" or "2 x 64"), which are those that `iters` WRITEs cycling over them
    reach: only the first ones when there are fewer WRITEs than pages."""
    what = f"{asked} pages" if checked == total else f"{checked} of {asked} pages"
    reach = "" if checked == total else f", the ones {iters} WRITEs reach"
    return f"verified {what} ({checked * page_size} bytes){reach}: {wrong} wrong bytes"


def next_client(poller, inbox, backlog):
    """A server's next CONNECT: the first of `backlog` (requests that came while it served
    the last client), else the next message in `inbox`; what is not a CONNECT is said in
    one line and skipped. None where the endpoint can serve no one (fabric.EndpointDeaf: a
    dead client's lock, or its request that 1.17 would crash on): said, and the server opens
    it again (renewing)."""
    while True:
        if not backlog:
            try:
                backlog.append(next_request(poller, inbox))
            except fi.EndpointDeaf as e:
                renewing(e)
                return None
        request = backlog.pop(0)
        if not stray(request):
            return request


def keep_arrived(poller, inbox, backlog):
    """Before a server closes its endpoint to open it again: a CONNECT already read from its
    CQ goes to `backlog`, served on the new one."""
    if fi.key(inbox.ctx) in poller.done:
        backlog.append(inbox.take(poller.done.pop(fi.key(inbox.ctx))))


def renewing(error):
    """The server's one line when its endpoint can serve no one (fabric.EndpointDeaf): it
    opens a new one at the same address, which the next client reaches."""
    print(f"{error}: opening the endpoint again at the same address", file=sys.stderr,
          flush=True)
    shm_files.remove_dead_peers()  # the killed client's region


def gone(error):
    """Whether `error` says that the peer is no longer there."""
    return (isinstance(error, fi.CompletionError)
            and errno.errorcode.get(abs(error.rc)) in PEER_GONE)  # shm's sign is flipped


def report(n, error):
    """The server's one line about client `n`, which it stopped serving on `error`; unless
    `error` came out of the clean-up of a Ctrl-C: then that goes on, and ends the server."""
    if usage.interrupted(error):
        raise KeyboardInterrupt from error
    what = "refused" if isinstance(error, Refused) else "gone" if gone(error) else "failed"
    print(f"client {n}: {what}: {error}", file=sys.stderr, flush=True)
    shm_files.remove_dead_peers()  # a client killed with -9 removed nothing

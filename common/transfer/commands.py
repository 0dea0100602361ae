"""The transfer engine's WRITE calls, which Engine inherits from Writes (a class of its
own for engine.py's length: its methods are Engine's): each builds a Command, checked in
one line before anything is posted, and hands it to its route, the C worker (libfabric)
or a CUDA IPC Route (ipc.py). Prepared: a command made once and written many times;
Group: scatter and barriers."""
import collections
import time

import numpy as np

from common.fabric import memory
from common.transfer import ipc
from common.transfer._native import ffi as _ffi, lib as native
from common.transfer.regions import SIGNAL, Peer, Region, RemoteRegion
from common.transfer.transfers import IpcTransfer, Transfer, _Several

RING = 1024            # commands queued at once (a power of two)


# A command, every argument checked but its items (pages_of's arrays): WRITE i goes from
# page src_items[i] of src to page dst_items[i] of dst, or from byte offset to byte offset
# where page_size is None; length bytes each, or lengths[i]
Command = collections.namedtuple(
    "Command", "peer src dst src_items dst_items page_size length lengths imm inject")


class Prepared:
    """A command made once and written many times (Engine.prepare_pages, prepare_list), as
    a KV cache's layers or a model's weights are sent again and again with the same layout.
    Its items are checked and turned into byte offsets once; on the CUDA IPC route its
    table goes to the GPU once, so that each write() is one kernel launch, with no pass
    over the items and no upload. On libfabric each write() hands the worker those
    offsets, shifted.

    write(imm, src_shift, dst_shift): the same WRITEs, every source item moved by
    src_shift and every destination item by dst_shift (pages, or bytes for prepare_list):
    chapter 18's layer l is layer 0's pages, shifted."""

    def __init__(self, engine, command):
        self.engine, self.command = engine, command
        self.unit = command.page_size or 1
        offsets = self.offsets = [offsets_of(command, side) for side in (0, 1)]  # checked
        ends = [o + (command.length if command.lengths is None else command.lengths)
                for o in offsets]
        self.reach = [int(e.max()) if len(e) else 0 for e in ends]  # the furthest byte
        self.route = engine._route(command)
        if self.route:
            self._on_gpu(offsets)

    def _on_gpu(self, offsets):
        """The kernel's table (byte offsets, then lengths), uploaded on the copier's stream
        for uploads, which its kernels' stream then waits for: an upload from pageable
        memory waits for its stream's earlier work, which on the kernels' stream would be
        the copies in flight. An IpcTransfer keeps the table until its kernel is done."""
        c, cp = self.command, memory.cupy()
        parts = offsets if c.lengths is None else [*offsets, c.lengths]
        memory.current(self.engine.gpu)
        copier = self.route.copier
        with copier.uploads:
            self.table = cp.asarray(np.concatenate(parts).astype(np.uint64))
            uploaded = cp.cuda.Event(disable_timing=True)
            uploaded.record()
        copier.stream.wait_event(uploaded)
        a = self.args = _ffi.new("struct tx_copy *")
        a.count, a.scale, a.length = len(offsets[0]), 1, c.length
        a.table, a.table_lengths = self.table.data.ptr, c.lengths is not None
        a.longest = c.length if c.lengths is None else int(c.lengths.max(initial=0))
        self.src, self.dst = c.src.ptr, self.route.address_of(c.dst)

    def write(self, imm=None, src_shift=0, dst_shift=0):
        eng, c = self.engine, self.command
        eng._check_imm(imm)
        if src_shift or dst_shift:  # the unshifted command was checked when it was made
            self._check_shifts(src_shift, dst_shift)
        if not self.route:  # the offsets checked when it was made, shifted
            eng._check()
            return eng._post(c._replace(imm=imm), self.offsets[0] + src_shift * self.unit,
                             self.offsets[1] + dst_shift * self.unit)
        # The CUDA IPC route, lean: a launch is ~6 us here and the kernel of 100 pages 6-8
        eng._check()
        route = self.route
        if not route.room():
            eng._room(route, c.peer)
        queued = time.monotonic_ns()
        record, seq = route.launch(self.args, imm, self.src + src_shift * self.unit,
                                   self.dst + dst_shift * self.unit)
        eng._ipc_commands += 1
        t = IpcTransfer(eng, record, seq, self.args.count, queued, time.monotonic_ns())
        t.keep = self.table  # read by the kernel until it is done
        return eng._track(t)

    def _check_shifts(self, src_shift, dst_shift):
        c = self.command
        for name, shift, region, reach in (("src_shift", src_shift, c.src, self.reach[0]),
                                           ("dst_shift", dst_shift, c.dst, self.reach[1])):
            if not isinstance(shift, (int, np.integer)) or shift < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {shift!r}")
            if reach + shift * self.unit > region.size:
                raise ValueError(f"{name} {shift} puts bytes up to {reach + shift * self.unit}"
                                 f" in a region of {region.size}")


class Group:
    """Engines that scatter and meet at barriers: `peers`, member i being peers[i]."""

    def __init__(self, engine, peers):
        self.engine, self.members = engine, list(peers)

    def scatter(self, src, dsts, length, imm=None):
        """Slice i of `src` (bytes [i*length, (i+1)*length)) to member i's region dsts[i]
        (at its start), each WRITE with `imm`. One Transfer for all of them."""
        if len(dsts) != len(self.members):
            raise ValueError(f"{len(dsts)} destinations for {len(self.members)} members")
        parts = [self.engine._command(p, src, np.array([i * length], np.uint64), d,
                                      np.zeros(1, np.uint64), length, imm)
                 for i, (p, d) in enumerate(zip(self.members, dsts))]
        for part in parts:  # all checked before the first is posted
            offsets_of(part, 0), offsets_of(part, 1)
        return _Several([self.engine._submit(part) for part in parts])

    def barrier(self, imm, timeout=None):
        """An 8-byte WRITE with `imm` to each member's signal region, then wait for one
        from each member (expect(imm, len(members)))."""
        timeout = self.engine.timeout if timeout is None else timeout
        eng = self.engine
        sent = [eng.signal(p, imm) for p in self.members]
        eng.expect(imm, len(self.members), timeout)
        for t in sent:
            t.wait(timeout)


class Writes:
    """Engine's WRITE calls (see the package's docstring)."""

    def write(self, peer, src, src_offset, dst, dst_offset, length, imm=None, inject=False):
        """One WRITE of `length` bytes from src[src_offset:] to dst[dst_offset:].

        inject=True (here and in write_pages, write_list): each WRITE of at most
        inject_size bytes is injected (fi_inject_write, fi_inject_writedata) and done once
        posted: the provider has copied its source, which may be reused at once, but
        nothing says it was delivered; the receiver's count of its immediate does. No
        command can say it failed: an error entry the provider writes for it (with no
        context) stops the engine, every later call raising. Longer WRITEs go as without
        inject, with a completion."""
        for name, value in (("src_offset", src_offset), ("dst_offset", dst_offset)):
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, not {value!r}")
        return self._submit(self._command(peer, src, np.array([src_offset], np.uint64), dst,
                                          np.array([dst_offset], np.uint64), length, imm,
                                          inject))

    def write_pages(self, peer, src, src_pages, dst, dst_pages, page_size, imm=None,
                    inject=False):
        """Page src_pages[i] of `src` to page dst_pages[i] of `dst` (page p: bytes
        [p*page_size, (p+1)*page_size)), one WRITE each, all posted by the worker."""
        return self._submit(self._pages(peer, src, src_pages, dst, dst_pages, page_size,
                                        imm, inject))

    def write_list(self, peer, src, src_offsets, dst, dst_offsets, lengths, imm=None,
                   inject=False):
        """WRITE i: lengths[i] bytes from src[src_offsets[i]:] to dst[dst_offsets[i]:],
        all posted by the worker (chapter 19: a layer's tensors of several sizes)."""
        return self._submit(self._list(peer, src, src_offsets, dst, dst_offsets, lengths,
                                       imm, inject))

    def prepare_pages(self, peer, src, src_pages, dst, dst_pages, page_size, inject=False):
        """write_pages made once, to be written many times (Prepared.write): its pages
        checked now, and on the CUDA IPC route its table put on the GPU now."""
        return Prepared(self, self._pages(peer, src, src_pages, dst, dst_pages, page_size,
                                          None, inject))

    def prepare_list(self, peer, src, src_offsets, dst, dst_offsets, lengths, inject=False):
        """write_list made once, to be written many times (Prepared.write)."""
        return Prepared(self, self._list(peer, src, src_offsets, dst, dst_offsets, lengths,
                                         None, inject))

    def _pages(self, peer, src, src_pages, dst, dst_pages, page_size, imm, inject):
        if not isinstance(page_size, (int, np.integer)) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, not {page_size!r}")
        src_pages, dst_pages = pages_of(src_pages, "src_pages"), pages_of(dst_pages, "dst_pages")
        if len(src_pages) != len(dst_pages):
            raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} "
                             "destination pages")
        return self._command(peer, src, src_pages, dst, dst_pages, page_size, imm, inject,
                             page_size=int(page_size))

    def _list(self, peer, src, src_offsets, dst, dst_offsets, lengths, imm, inject):
        offsets = [pages_of(x, name, "byte counts") for x, name in (
            (src_offsets, "src_offsets"), (dst_offsets, "dst_offsets"), (lengths, "lengths"))]
        if len({len(x) for x in offsets}) != 1:
            raise ValueError(f"{len(offsets[0])} source offsets, {len(offsets[1])} "
                             f"destination offsets and {len(offsets[2])} lengths")
        if len(offsets[2]) and offsets[2].dtype.kind == "i" and offsets[2].min() < 0:
            raise ValueError(f"lengths has a negative byte count ({int(offsets[2].min())})")
        return self._command(peer, src, offsets[0], dst, offsets[1],
                             offsets[2].astype(np.uint64), imm, inject)

    def _check_ends(self, peer, src, dst):
        if not isinstance(peer, Peer) or self._peers.get(peer.id) is not peer:
            raise ValueError("that peer is not one of this engine's (use Engine.connect)")
        if not isinstance(src, Region) or src.engine is not self:
            raise ValueError("the source must be a region registered by this engine "
                             "(Engine.register)")
        if not isinstance(dst, RemoteRegion):
            raise ValueError("the destination must be a RemoteRegion (Engine.remote)")

    def _command(self, peer, src, src_items, dst, dst_items, length, imm, inject=False,
                 page_size=None):
        """A Command, every argument checked but the items (_submit's route checks them as
        it builds the WRITEs' offsets): ValueError, nothing posted. The items are page
        numbers of `page_size` bytes, or byte offsets (page_size None), int64 or uint64
        (pages_of); `length`: every WRITE's, or an array of one per WRITE."""
        self._check()
        self._check_ends(peer, src, dst)
        lengths = length if isinstance(length, np.ndarray) else None
        if lengths is None and not isinstance(length, (int, np.integer)):
            raise ValueError(f"a WRITE's length must be an integer, not {length!r}")
        sizes = [length] if lengths is None else \
            [int(lengths.min()), int(lengths.max())] if len(lengths) else []
        for size in sizes:
            if not 0 < size <= self.max_write:
                raise ValueError(f"a WRITE's length must be 1 to {self.max_write} bytes "
                                 f"({self.provider}'s largest), not {size}")
        self._check_imm(imm)
        return Command(peer, src, dst, src_items, dst_items, page_size,
                       0 if lengths is not None else int(length), lengths, imm, inject)

    def _check_imm(self, imm):
        bits = 8 * self.cq_data_size
        if imm is not None and (not isinstance(imm, (int, np.integer))
                                or not 0 <= imm < 1 << bits):
            raise ValueError(f"imm {imm!r} does not fit the {self.cq_data_size} bytes of "
                             f"immediate data {self.provider} carries (0 to {(1 << bits) - 1})")

    def _route(self, command):
        """The ipc.Route that carries `command`, or None: libfabric."""
        peer, src, dst = command.peer, command.src, command.dst
        return peer.ipc if peer.ipc and dst.ipc and src.gpu == self.gpu else None

    def _submit(self, command):
        self._check()
        route = self._route(command)
        if route:
            return self._submit_ipc(route, command)
        return self._post(command, offsets_of(command, 0), offsets_of(command, 1))

    def _post(self, command, src_offsets, dst_offsets):
        """Hand the worker `command`, its items as byte offsets already checked."""
        peer, src, dst = command.peer, command.src, command.dst
        w = self._w
        if w.head - native.tx_tail(w) >= RING:
            self._until(lambda: w.head - native.tx_tail(w) < RING, self.timeout,
                        lambda: f"room in the worker's ring of {RING} commands")
        c = _ffi.new("struct tx_command *")
        c.count, c.length = len(src_offsets), command.length
        if command.lengths is not None:
            c.lengths = _ffi.cast("uint64_t *", command.lengths.ctypes.data)
        c.src = _ffi.cast("uint64_t *", src_offsets.ctypes.data)
        c.dst = _ffi.cast("uint64_t *", dst_offsets.ctypes.data)
        c.local_base = _ffi.cast("char *", src.ptr)
        c.local_descs, c.remote_base, c.remote_key = src.descs, dst.bases, dst.keys
        c.addr = peer.addr
        c.round_robin = self.spread == "round-robin"
        c.nic = peer.nic
        c.has_imm, c.imm = command.imm is not None, command.imm or 0
        c.inject_size = self.inject_size if command.inject else 0
        t = self._track(Transfer(self, c, (command, src_offsets, dst_offsets)))
        native.tx_submit(w, c)
        return t

    def _submit_ipc(self, route, command):
        self._room(route, command.peer)
        queued = time.monotonic_ns()
        record, seq, bad = route.submit(
            command, lambda ready, why: self._until(ready, self.timeout, why))
        if bad:
            refuse(command, *bad)
        self._ipc_commands += 1
        return self._track(IpcTransfer(self, record, seq, len(command.src_items), queued,
                                       time.monotonic_ns()))

    def _room(self, route, peer):
        if not route.room():
            self._until(route.room, self.timeout, lambda: (
                f"peer {peer.index} took none of our last {ipc.RECORDS} commands by "
                f"CUDA IPC within {self.timeout:g} s: is it still running?"))

    def _track(self, transfer):
        """Hold `transfer` (and what it keeps alive) until it is done."""
        self._inflight.append(transfer)
        if len(self._inflight) > self._prune_at:  # now and then: each .done costs a read
            self._inflight = [x for x in self._inflight if not x.done]
            self._prune_at = 2 * len(self._inflight) + 16
        return transfer

    def signal(self, peer, imm):
        """An 8-byte WRITE with `imm` into the peer's signal region: a message that is
        only its immediate (the peer expects it)."""
        return self.write(peer, self._signal, 0, peer.signal, 0, SIGNAL, imm)


def pages_of(pages, name, what="page numbers"):
    """`pages` as a contiguous int64 or uint64 array (itself where it is one): ValueError
    unless it is a sequence of integers. offsets_of checks their values."""
    array = np.asarray(pages)
    if array.ndim != 1 or (len(array) and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a sequence of {what}")
    if array.dtype not in (np.int64, np.uint64) or not array.flags.c_contiguous:
        array = np.ascontiguousarray(array, np.uint64 if array.dtype.kind == "u" else np.int64)
    return array


def offsets_of(command, side):
    """The byte offsets (a new uint64 array) of a command's items on `side` (0: source,
    1: destination), built and checked in one pass of C (tx_offsets); refuse() the first
    that is negative or puts its WRITE out of its region."""
    items = command.dst_items if side else command.src_items
    out = np.empty(len(items), np.uint64)
    lengths = command.lengths
    at = native.tx_offsets(_ffi.from_buffer(items), items.dtype.kind == "i", len(items),
                           command.page_size or 1, command.length,
                           _ffi.NULL if lengths is None else _ffi.from_buffer("uint64_t[]", lengths),
                           (command.dst if side else command.src).size,
                           _ffi.from_buffer("uint64_t[]", out))
    if at >= 0:
        refuse(command, side, at)
    return out


def refuse(command, side, at):
    """ValueError for item `at` of the command's `side`, found out of range."""
    items, region = (command.dst_items, command.dst) if side else (command.src_items, command.src)
    paged, item = command.page_size is not None, int(items[at])
    n = int(command.length if command.lengths is None else command.lengths[at])
    where = ("destination", "dst") if side else ("source", "src")
    arg = where[1] + ("_pages" if paged else "_offsets")
    if item < 0:
        what = "page number" if paged else "byte offset"
        raise ValueError(f"{arg} has a negative {what} ({item})")
    if paged:
        raise ValueError(f"{where[0]} page {item} is out of range: the region holds "
                         f"{region.size // command.page_size} pages of {command.page_size} bytes")
    raise ValueError(f"{where[0]} bytes {item}..{item + n} are out of range: the region has "
                     f"{region.size}")

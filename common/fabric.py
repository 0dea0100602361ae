"""A thin Python face on libfabric: one function per fi_* call, errors as exceptions.

Every function here is the libfabric call of the same name with its output
parameters turned into return values and its negative return codes turned
into FabricError. Nothing is hidden: chapter 04 calls them one by one, in
the order libfabric wants them.

    with Closer() as own:                  # closes everything in reverse order
        fabric = own(fabric_open(info))
        domain = own(domain_open(fabric, info))
        ...
"""
import contextlib
import os
import signal
import sys
import threading
import time

try:
    from common._fabric import ffi, lib
except ImportError as e:  # not built, or libfabric.so gone since
    sys.exit(f"libfabric binding unavailable ({e}): run 'bash scripts/setup.sh'")
from common import rules  # FABRIC_RULES=efa|verbs: every call checked as those NICs would

# The API version our headers describe; libfabric 2.x still serves 1.x callers.
API_VERSION = (lib.FI_MAJOR_VERSION << 16) | lib.FI_MINOR_VERSION

# What we can cope with: we register every buffer (LOCAL), we send the peer
# absolute addresses when the provider wants them (VIRT_ADDR), buffers are
# always allocated (ALLOCATED), we forward provider keys (PROV_KEY) and we
# register GPU memory with its iface (HMEM).
MR_MODE = (lib.FI_MR_LOCAL | lib.FI_MR_VIRT_ADDR | lib.FI_MR_ALLOCATED
           | lib.FI_MR_PROV_KEY | lib.FI_MR_HMEM)

# Provider names libfabric has shipped; used only to tell "no such provider"
# apart from "that provider has no device on this host".
KNOWN_PROVIDERS = {"efa", "verbs", "shm", "sm2", "tcp", "udp", "sockets", "net", "psm2",
                   "psm3", "opx", "cxi", "usnic", "ucx", "lpp", "lnx", "ofi_rxm", "ofi_rxd"}
# Tried in this order when no provider is named: real NICs first.
DEFAULT_PROVIDERS = ("efa", "verbs", "shm", "tcp")


class FabricError(RuntimeError):
    """A libfabric call failed. Carries the call's name, its return code and libfabric's text."""

    def __init__(self, call, rc, text=None):
        self.call, self.rc = call, rc
        self.text = text if text is not None else strerror(rc)
        super().__init__(f"{call}: {self.text} (ret {rc})")


class CompletionError(FabricError):
    """An operation completed with an error; the text is the provider's own (fi_cq_strerror)."""

    def __init__(self, rc, text, context):
        self.context = context
        super().__init__("fi_cq_read", rc, text)


def strerror(rc):
    return rules.text(rc) or ffi.string(lib.fi_strerror(abs(rc))).decode()


def check(call, rc):
    if rc < 0:
        raise FabricError(call, rc)
    return rc


def version():
    """The version of the libfabric library loaded at run time, as (major, minor)."""
    v = lib.fi_version()
    return v >> 16, v & 0xFFFF


def tostr(value, kind):
    """libfabric's own spelling of a flag set, e.g. tostr(caps, lib.FI_TYPE_CAPS)."""
    return ffi.string(lib.fi_tostr(ffi.new("uint64_t *", value), kind)).decode()


# --- fi_info ---------------------------------------------------------------

# We give every operation a fi_context2, and keep a receive posted wherever
# immediate data may arrive, so we can accept providers that want either.
MODE = lib.FI_CONTEXT | lib.FI_CONTEXT2 | lib.FI_RX_CQ_DATA


def hints(provider=None, ep_type=lib.FI_EP_RDM, caps=lib.FI_MSG, mr_mode=MR_MODE, mode=MODE):
    """An fi_info to pass to getinfo (fi_allocinfo: required from libfabric 2.0)."""
    info = ffi.gc(lib.fi_allocinfo(), lib.fi_freeinfo)
    if info == ffi.NULL:
        raise FabricError("fi_allocinfo", -lib.FI_ENOMEM)
    info.caps = caps
    info.mode = mode
    info.ep_attr.type = ep_type
    info.domain_attr.mr_mode = mr_mode
    if provider:
        info.fabric_attr.prov_name = lib.strdup(provider.encode())  # freed by fi_freeinfo
    return info


def getinfo(hint):
    """fi_getinfo: the list of (provider, domain) pairs that satisfy the hints."""
    out = ffi.new("struct fi_info **")
    rules.restrict(hint)
    rc = lib.fi_getinfo(API_VERSION, ffi.NULL, ffi.NULL, 0, hint, out)
    _take_back_signals()
    check("fi_getinfo", rc)
    return ffi.gc(rules.with_twins(out[0]), lib.fi_freeinfo)


_interrupting = True  # False once the process is saying its last words (cli.run)


def _interrupted(signum, frame):
    if _interrupting:
        raise KeyboardInterrupt


def stop_interrupting():
    """From now on Ctrl-C and SIGTERM interrupt nothing, one already on its way included:
    the process is reporting and exiting."""
    global _interrupting
    _interrupting = False


def _take_back_signals():
    """Undo what provider libraries did to SIGINT/SIGTERM while libfabric loaded them.

    Debian's libfabric loads PSM (libinfinipath), whose handlers call exit(1):
    Ctrl-C would skip our clean-up. shm's handler, installed later, removes
    its /dev/shm files and then chains to whatever was there before: ours.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupted)
        signal.signal(signal.SIGTERM, _interrupted)


_take_back_signals()  # loading the binding is enough for PSM's handlers to be installed


def dupinfo(info):
    """fi_dupinfo: a copy of one entry (without its `next`), owned by the caller."""
    copy = lib.fi_dupinfo(info)
    if copy == ffi.NULL:
        raise FabricError("fi_dupinfo", -lib.FI_ENOMEM)
    return ffi.gc(copy, lib.fi_freeinfo)


def each(head):
    """Walk an fi_info list (holding on to its head, which owns the list)."""
    info = head
    while info != ffi.NULL:
        yield info
        info = info.next


def string(cstr):
    return ffi.string(cstr).decode() if cstr != ffi.NULL else ""


def provider_of(info):
    return string(info.fabric_attr.prov_name)


def pick(provider=None, caps=lib.FI_MSG, prefer=0):
    """The fi_info list for `provider`, or for the first of DEFAULT_PROVIDERS that works here.

    Capabilities in `prefer` are asked for too where the provider has them.
    Returns (info, why) where `why` says, for the reader, how it was chosen.
    Raises ValueError with one readable line when nothing fits.
    """
    if prefer:
        try:
            return pick(provider, caps | prefer)
        except (ValueError, FabricError):
            pass
    if provider:
        if not set(provider.split(";")) <= KNOWN_PROVIDERS:
            raise ValueError(f"unknown provider '{provider}' (libfabric has: "
                             f"{', '.join(sorted(KNOWN_PROVIDERS))})")
        try:
            return getinfo(hints(provider, caps=caps)), "asked for"
        except FabricError as e:
            if e.rc != -lib.FI_ENODATA:
                raise
            raise ValueError(f"provider '{provider}' has no usable device here "
                             f"(usable: {', '.join(usable(caps)) or 'none'})") from None
    for name in DEFAULT_PROVIDERS:
        try:
            info = getinfo(hints(name, caps=caps))
        except FabricError:
            continue
        skipped = DEFAULT_PROVIDERS[:DEFAULT_PROVIDERS.index(name)]
        return info, (f"default: no {'/'.join(skipped)} device here" if skipped else "default")
    raise ValueError(f"none of {', '.join(DEFAULT_PROVIDERS)} is usable here")


def usable(caps=lib.FI_MSG):
    """Names of the providers that offer an RDM endpoint with `caps` on this host."""
    try:
        return sorted({provider_of(i) for i in each(getinfo(hints(caps=caps)))})
    except FabricError:
        return []


def check_address(info, addr):
    """Raise ValueError unless `addr` has the shape of an address of this provider."""
    if info.addr_format == lib.FI_ADDR_STR:
        if not (addr.endswith(b"\0") and b"://" in addr and addr[:-1].isascii()):
            raise ValueError(f"{provider_of(info)} addresses are NUL-terminated strings "
                             f"like 'fi_shm://...'; got {len(addr)} other bytes")
    elif info.src_addrlen and len(addr) != info.src_addrlen:
        raise ValueError(f"{provider_of(info)} addresses are {info.src_addrlen} bytes; "
                         f"got {len(addr)}")


# --- objects ---------------------------------------------------------------

def _open(call, ctype, fn, *args):
    out = ffi.new(ctype + " **")
    check(call, fn(*args, out, ffi.NULL))
    return out[0]


def fabric_open(info):
    return _open("fi_fabric", "struct fid_fabric", lib.fi_fabric, info.fabric_attr)


def domain_open(fabric, info):
    return _open("fi_domain", "struct fid_domain", lib.fi_domain, fabric, info)


def endpoint_open(domain, info):
    return _open("fi_endpoint", "struct fid_ep", lib.fi_endpoint, domain, info)


def cq_open(domain, size):
    """A completion queue whose entries carry immediate data (FI_CQ_FORMAT_DATA)."""
    attr = ffi.new("struct fi_cq_attr *", {"size": size, "format": lib.FI_CQ_FORMAT_DATA,
                                           "wait_obj": lib.FI_WAIT_NONE})
    return _open("fi_cq_open", "struct fid_cq", lib.fi_cq_open, domain, attr)


def av_open(domain, count=16):
    attr = ffi.new("struct fi_av_attr *", {"type": lib.FI_AV_TABLE, "count": count})
    return _open("fi_av_open", "struct fid_av", lib.fi_av_open, domain, attr)


def fid(obj):
    return ffi.cast("struct fid *", obj)


def ep_bind(ep, obj, flags=0):
    check("fi_ep_bind", lib.fi_ep_bind(ep, fid(obj), flags))


def enable(ep):
    check("fi_enable", lib.fi_enable(ep))


def getname(ep):
    """The endpoint's raw address: what a peer needs to reach it."""
    size = ffi.new("size_t *", 256)
    buf = ffi.new("char[]", size[0])
    check("fi_getname", lib.fi_getname(fid(ep), buf, size))
    return ffi.buffer(buf, size[0])[:]


def av_insert(av, addr):
    """Insert one raw address; returns the fi_addr_t to send to."""
    out = ffi.new("fi_addr_t *")
    n = check("fi_av_insert", lib.fi_av_insert(av, addr, 1, out, 0, ffi.NULL))
    if n != 1:
        raise FabricError("fi_av_insert", -lib.FI_EINVAL, "address rejected")
    return out[0]


def av_remove(av, fi_addr):
    check("fi_av_remove", lib.fi_av_remove(av, ffi.new("fi_addr_t *", fi_addr), 1, 0))


def mr_reg(domain, buf, size, access, key, iface=lib.FI_HMEM_SYSTEM, device=0, flags=0):
    """fi_mr_regattr. `buf` is a cdata pointer or an integer address (e.g. GPU memory).

    `key` is our requested key; providers with FI_MR_PROV_KEY pick their own,
    so always send the peer fi_mr_key(mr), never `key`.
    """
    out = ffi.new("struct fid_mr **")
    check("fi_mr_regattr", lib.tut_mr_reg(domain, ffi.cast("void *", buf), size, access, key,
                                          iface, device, flags, out))
    return out[0]


def mr_key(mr):
    return lib.fi_mr_key(mr)


def mr_desc(mr):
    return lib.fi_mr_desc(mr)


def close(obj):
    if isinstance(obj, ffi.CData) and ffi.typeof(obj) is ffi.typeof("struct fi_info *"):
        return  # fi_info lists are freed by the garbage collector (ffi.gc above)
    check("fi_close", lib.fi_close(fid(obj)))


class Closer(contextlib.ExitStack):
    """Owns libfabric objects and closes them in reverse order of opening, also on error."""

    def __call__(self, obj):
        self.callback(close, obj)
        return obj


def open_endpoint(own, info, cq_size=64, av_count=16):
    """fabric -> domain -> CQ + AV -> endpoint, bound and enabled (taught in chapter 04).

    `own` is a Closer; returns (domain, cq, av, ep).
    """
    fabric = own(fabric_open(info))
    domain = own(domain_open(fabric, info))
    cq = own(cq_open(domain, size=cq_size))
    av = own(av_open(domain, av_count))
    ep = own(endpoint_open(domain, info))
    ep_bind(ep, cq, lib.FI_SEND | lib.FI_RECV)
    ep_bind(ep, av)
    enable(ep)
    return domain, cq, av, ep


# --- data path -------------------------------------------------------------

def posted(call, rc):
    """True when an operation was posted, False on -FI_EAGAIN (try again later)."""
    if rc == -lib.FI_EAGAIN:
        return False
    check(call, rc)
    return True


def _msg(buf, size, desc, addr, context, data=0):
    iov = ffi.new("struct iovec *", {"iov_base": ffi.cast("void *", buf), "iov_len": size})
    descs = ffi.new("void *[1]", [desc])
    msg = ffi.new("struct fi_msg *", {"msg_iov": iov, "desc": descs, "iov_count": 1,
                                      "addr": addr, "context": context, "data": data})
    return msg, (iov, descs)  # the second item keeps the pieces alive during the call


def sendmsg(ep, buf, size, desc, dest, context, flags=lib.FI_COMPLETION):
    msg, _keep = _msg(buf, size, desc, dest, context)
    return posted("fi_sendmsg", lib.fi_sendmsg(ep, msg, flags))


def recvmsg(ep, buf, size, desc, src, context, flags=lib.FI_COMPLETION):
    msg, _keep = _msg(buf, size, desc, src, context)
    return posted("fi_recvmsg", lib.fi_recvmsg(ep, msg, flags))


def writemsg(ep, buf, size, desc, dest, remote_addr, remote_key, context, data=None,
             flags=lib.FI_COMPLETION):
    """One-sided WRITE; with `data`, the peer also gets a completion carrying it."""
    iov = ffi.new("struct iovec *", {"iov_base": ffi.cast("void *", buf), "iov_len": size})
    descs = ffi.new("void *[1]", [desc])
    rma = ffi.new("struct fi_rma_iov *", {"addr": remote_addr, "len": size, "key": remote_key})
    msg = ffi.new("struct fi_msg_rma *", {
        "msg_iov": iov, "desc": descs, "iov_count": 1, "addr": dest, "rma_iov": rma,
        "rma_iov_count": 1, "context": context, "data": data or 0})
    if data is not None:
        flags |= lib.FI_REMOTE_CQ_DATA
    return posted("fi_writemsg", lib.fi_writemsg(ep, msg, flags))


def inject(ep, buf, size, dest):
    """fi_inject: a small SEND that never makes a completion; `buf` is reusable at once."""
    return posted("fi_inject", lib.fi_inject(ep, buf, size, dest))


def remote_base(info, ptr):
    """What the peer adds a page's offset to: the address itself with FI_MR_VIRT_ADDR,
    else 0 (offsets into the registration). Taught in chapter 06."""
    return ptr if info.domain_attr.mr_mode & lib.FI_MR_VIRT_ADDR else 0


class Inbox:
    """One registered message buffer with a receive posted in it (chapter 06)."""

    def __init__(self, own, domain, ep, size):
        self.mem, self.size = ffi.new("char[]", size), size
        mr = own(mr_reg(domain, self.mem, size, lib.FI_RECV, key=1000))
        self.desc, self.ctx, self.ep = mr_desc(mr), ffi.new("struct fi_context2 *"), ep
        self.post()

    def post(self):
        if not recvmsg(self.ep, self.mem, self.size, self.desc, lib.FI_ADDR_UNSPEC, self.ctx):
            raise FabricError("fi_recvmsg", -lib.FI_EAGAIN)

    def take(self, length):
        """The message that arrived, and a receive posted again for the next one."""
        message = ffi.buffer(self.mem, length)[:]
        self.post()
        return message


def native_error(rc, cq, call):
    """The exception for `rc`, a negative return of C code that called `call` on `cq`:
    for -FI_EAVAIL, the failed operation's error entry, in the provider's words."""
    if rc == -lib.FI_EAVAIL:
        try:
            cq_read(cq, cq_entries(1))
        except FabricError as e:
            return e
    return FabricError(call, rc)


def cq_entries(count):
    return ffi.new("struct fi_cq_data_entry[]", count)


def cq_read(cq, entries):
    """fi_cq_read into `entries`: the number read, 0 when there is nothing yet.

    An operation that failed raises CompletionError with the provider's text.
    Polling is also what drives progress on most providers.
    """
    n = lib.fi_cq_read(cq, entries, len(entries))
    if n == -lib.FI_EAGAIN:
        return 0
    if n == -lib.FI_EAVAIL:
        err = ffi.new("struct fi_cq_err_entry *")
        check("fi_cq_readerr", lib.fi_cq_readerr(cq, err, 0))
        text = string(lib.fi_cq_strerror(cq, err.prov_errno, err.err_data, ffi.NULL, 0))
        raise CompletionError(-err.err, text or strerror(err.err), err.op_context)
    return check("fi_cq_read", n)


def key(context):
    """A hashable identity for an operation context (a cdata pointer)."""
    return int(ffi.cast("uintptr_t", context))


class Poller:
    """Reads a CQ and keeps each completion, by operation context, until it is asked for.

    With several operations in flight, completions come in any order; waiting
    for one must not lose the others. Immediate data from a peer's WRITE
    (FI_REMOTE_CQ_DATA) is kept apart, in arrival order.
    """

    def __init__(self, cq, batch=16):
        self.cq, self.entries = cq, cq_entries(batch)
        self.done, self.remote_data = {}, []

    def poll(self):
        n = cq_read(self.cq, self.entries)
        for e in self.entries[0:n]:
            self.keep(e)
        return n

    def keep(self, entry):
        """File one completion away (also for readers of the same CQ that met one not theirs)."""
        if entry.flags & lib.FI_REMOTE_CQ_DATA:  # test the flag: tcp reports len 0 here
            self.remote_data.append(entry.data)
        if entry.op_context != ffi.NULL:
            self.done[key(entry.op_context)] = entry.len

    def _until(self, ready, timeout, what):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if not self.poll():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"no {what} within {timeout:g} s")
                # Let a peer on the same core run. Not time.sleep(0): that is a real
                # sleep (~50 us of timer slack), which cut tcp's throughput by 5x here.
                os.sched_yield()

    def until_posted(self, post, timeout, what):
        """Call `post` until the provider takes the operation (it returns False on
        -FI_EAGAIN: queue full, or tcp still connecting), polling for progress meanwhile."""
        deadline = time.monotonic() + timeout
        while not post():
            self.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:g} s: is the peer running?")

    def send(self, own, domain, ep, data, dest, key, timeout, what, hint=""):
        """SEND the bytes `data` from a buffer registered for it (with requested `key`),
        and wait for its completion; `what` names it in a timeout's message."""
        buf = ffi.new("char[]", data)
        mr = own(mr_reg(domain, buf, len(data), lib.FI_SEND, key=key))
        ctx = ffi.new("struct fi_context2 *")
        self.until_posted(lambda: sendmsg(ep, buf, len(data), mr_desc(mr), dest, ctx), timeout,
                          f"{what} accepted")
        self.wait([ctx], timeout, f"{what} completion{hint}")

    def wait(self, contexts, timeout, what, or_remote_data=False):
        """Wait until one of `contexts` completes: returns (that context, bytes received).
        With `or_remote_data`, immediate data arriving first ends the wait: (None, 0)."""
        self._until(lambda: any(key(c) in self.done for c in contexts)
                    or (or_remote_data and self.remote_data), timeout, what)
        ctx = next((c for c in contexts if key(c) in self.done), None)
        return (None, 0) if ctx is None else (ctx, self.done.pop(key(ctx)))

    def wait_all(self, contexts, timeout, what):
        """Wait until every one of `contexts` has completed."""
        self._until(lambda: all(key(c) in self.done for c in contexts), timeout, what)
        for c in contexts:
            del self.done[key(c)]

    def wait_remote_data(self, timeout, what):
        """The immediate data of the next WRITE that carried some."""
        self._until(lambda: self.remote_data, timeout, what)
        return self.remote_data.pop(0)

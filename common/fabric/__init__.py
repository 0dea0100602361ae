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
import re
import signal
import socket
import sys
import threading
import time

from common import bounds, shm_files

# Loading libfabric loads its providers, and Debian's PSM (libinfinipath) installs handlers
# for SIGINT, SIGTERM and the crash signals that print a backtrace: a Ctrl-C then ended the
# process with 1, skipping everything. Asked not to (its IPATH_NO_BACKTRACE); and, for
# other providers' handlers, ours are put back once it has loaded (_take_back_signals)
# while the signals are held off this thread. Held off this thread only: a thread numpy
# had started (OpenBLAS's) still took a SIGTERM in that window, to libinfinipath's
# handler, and the process ran on as if none had come (8 of 40 SIGTERMs sent to a rank
# of 19 as it started; a launcher killed then left its ranks running).
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")
_held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
try:
    from common._fabric import ffi, lib
except ImportError as e:  # not built, or libfabric.so gone since
    sys.exit(f"libfabric binding unavailable ({e}): run 'bash scripts/setup.sh'")
from common.fabric import rules  # FABRIC_RULES=efa|efa-direct|verbs: calls checked as those NICs would

# The shm provider names an endpoint's region after this process's pid and refuses
# (fi_enable: EBUSY) to reuse a region of that name whose recorded creator is alive
# (prov/shm/src/smr_util.c, smr_retry_map): this very process, when one that had this pid
# before, SIGKILLed, left its region and the pids came round (after 32768 by Linux's default
# pid_max; one run of our tests takes some 9,400). No endpoint of ours exists yet, so a region
# carrying our pid is such a leftover.
shm_files.remove_left_by([os.getpid()])

# The API version our headers describe; libfabric 2.x still serves 1.x callers.
API_VERSION = (lib.FI_MAJOR_VERSION << 16) | lib.FI_MINOR_VERSION
LIBFABRIC = re.compile(r"libfabric(-[0-9a-f]+)?\.so(\.\d+)*")  # also a wheel's (auditwheel)


def libfabrics(maps):
    """The libfabric.so files mapped, per `maps` (the text of /proc/PID/maps), each once;
    also those a wheel bundles renamed (auditwheel: libfabric-<hash>.so.1)."""
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        path = fields[5] if len(fields) == 6 else ""
        if LIBFABRIC.fullmatch(os.path.basename(path)) and path not in found:
            found.append(path)
    return found


def loaded_from():
    """The path of the libfabric.so this process has loaded, or None."""
    try:
        with open("/proc/self/maps") as maps:
            return next(iter(libfabrics(maps.read())), None)
    except OSError:
        return None


def loads_from(prefix):
    """Whether the libfabric this binding loaded lies under `prefix` (an install prefix)."""
    path = loaded_from()
    return path is not None and os.path.realpath(path).startswith(
        os.path.realpath(prefix) + os.sep)


def prefix_mismatch():
    """LIBFABRIC_PREFIX picks a libfabric when the binding is built (scripts/setup.sh); set
    for a program, it must name the one the binding loads: else a reader on a p5 could
    believe the EFA installer's in use while another runs. None, or one line saying which
    is loaded and how to rebuild. Unset or empty (setup.sh's "the system's"): None."""
    prefix = os.environ.get("LIBFABRIC_PREFIX")
    if not prefix or loads_from(prefix):
        return None
    return (f"LIBFABRIC_PREFIX={prefix}, but the binding loads "
            f"{os.path.realpath(loaded_from() or '?')} (libfabric {'%d.%d' % version()}): to "
            f"use that one, rebuild the binding: LIBFABRIC_PREFIX={prefix} bash "
            "scripts/setup.sh; or unset it")

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

# We ask for no mode bits: the fabrics we use need none (efa's RDM fabric clears
# FI_CONTEXT2, prov/efa/src/efa_prov_info.c; rxm strips FI_RX_CQ_DATA,
# prov/rxm/src/rxm_init.c; shm and tcp ask for nothing). A mode offered is a
# burden accepted: FI_CONTEXT2 is what lets efa-direct in (DIRECT_MODE), FI_RX_CQ_DATA
# would oblige us to post a receive for every immediate. Every operation still has
# a fi_context2 of its own: that is how its completion names it.
MODE = 0

# The fabric each provider's chapters use where the provider has several.
# efa lists "efa-direct" before "efa" from libfabric 2.1 (prov/efa/src/efa_prov.c).
# efa-direct sizes the device CQ to exactly what we ask (prov/efa/src/efa_cq.h) and
# neither splits a SEND nor keeps it within the MTU (efa_msg.c); the RDM fabric "efa"
# does both, as the series' demo and pplx-garden get it. -p efa is "efa".
FABRICS = {"efa": "efa"}
# -p names that are a fabric of a provider: (provider, fabric), as fi_info names them.
# efa-direct is the device alone, each call one work request (chapter 07 says what it demands).
DIRECT = "efa-direct"
NAMED_FABRICS = {DIRECT: ("efa", DIRECT)}
# efa-direct lists entries only for callers that give every operation a struct
# fi_context2 for the provider's own use (efa_prov_info.c; prov/efa/src/efa.h
# efa_fill_context writes it): ours all have one.
DIRECT_MODE = lib.FI_CONTEXT2
# The libfabric whose efa fabric rings the doorbell of a WRITE it queued with FI_MORE
# (main's 3b01e1417). Up to 2.6.0 it posts a queued WRITE again with the WRITE's own flags
# (rdm/efa_rdm_ope.c efa_rdm_ope_process_queued_ope, then rdm/efa_rdm_pke.c
# efa_rdm_pke_write: txe->fi_flags), so no post of ours closes that batch. 2.4.x has the
# fix too, as PR 12628, from a patch release: fi_version() gives major.minor only, so 2.4
# counts as without it. Chapter 14 and the doctor read it.
EFA_RINGS_QUEUED = (2, 7)
# The libfabric whose efa counts completions in the device's counters by default
# (FI_EFA_USE_HW_CNTR, main's f55dd70db; man/fi_efa.7.md): reading such a counter makes no
# progress, so a caller that waits on one must still read a CQ on -FI_EAGAIN. The
# chapters count nothing with fi_cntr: only the doctor says it.
EFA_HW_COUNTERS = (2, 7)


def hints(provider=None, ep_type=lib.FI_EP_RDM, caps=lib.FI_MSG, mr_mode=MR_MODE, mode=MODE,
          fabric=True):
    """An fi_info to pass to getinfo (fi_allocinfo: required from libfabric 2.0).
    `fabric` False: every fabric of the provider, not only the one in FABRICS."""
    info = ffi.gc(lib.fi_allocinfo(), lib.fi_freeinfo)
    if info == ffi.NULL:
        raise FabricError("fi_allocinfo", -lib.FI_ENOMEM)
    info.caps = caps
    # FABRIC_RULES=efa-direct: the hints -p efa-direct gives, on whatever provider runs
    info.mode = mode | (DIRECT_MODE if DIRECT in (provider, rules.MODE) else 0)
    info.ep_attr.type = ep_type
    info.domain_attr.mr_mode = mr_mode
    if provider:
        provider, name = NAMED_FABRICS.get(provider, (provider, fabric and FABRICS.get(provider)))
        info.fabric_attr.prov_name = lib.strdup(provider.encode())  # freed by fi_freeinfo
        if name:  # 2.1's core drops other fabrics' entries (src/fabric.c); 1.x's does
            # not, but its efa has no efa-direct
            info.fabric_attr.name = lib.strdup(name.encode())
    return info


def getinfo(hint, flags=0):
    """fi_getinfo: the list of (provider, domain) pairs that satisfy the hints."""
    out = ffi.new("struct fi_info **")
    check("fi_getinfo", rules.restrict(hint))
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:  # the first fi_getinfo loads the providers (see _held above)
        rc = lib.fi_getinfo(API_VERSION, ffi.NULL, ffi.NULL, flags, hint, out)
    finally:
        _take_back_signals()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    check("fi_getinfo", rc)
    return ffi.gc(rules.with_twins(out[0]), lib.fi_freeinfo)


_interrupting = True  # False once the process is saying its last words (cli.run)


def _interrupted(signum, frame):
    if bounds.forked():  # a child not yet exec'd: its parent stops it (bounds.forked)
        return
    bounds.noted(signum)  # which one: the exit code says it (bounds.exit_code)
    if not bounds.watching() and bounds.importing(frame):  # a program before its main(): nothing
        bounds.end("interrupted before it started", bounds.exit_code())  # is open to close
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
for _early in signal.sigpending() & {signal.SIGINT, signal.SIGTERM}:  # came while it loaded:
    bounds.noted(_early)                                          # nothing is open to close
    bounds.end("interrupted while libfabric loaded", bounds.exit_code())
signal.pthread_sigmask(signal.SIG_SETMASK, _held)


def dupinfo(info):
    """fi_dupinfo: a copy of one entry (without its `next`), owned by the caller."""
    copy = lib.fi_dupinfo(info)
    if copy == ffi.NULL:
        raise FabricError("fi_dupinfo", -lib.FI_ENOMEM)
    return ffi.gc(copy, lib.fi_freeinfo)


SHM_PREFIX = b"fi_shm://"  # SMR_PREFIX, prov/shm/src/smr_util.h
CONNREQ_CHECKED = 2 << 16  # the API version from which shm checks that it mapped a requester
CONNREQ_GRACE = 2.0  # seconds a client about to give up leaves its connection request to be read


def connreq_pending(ep, post, poll):
    """Before a client gives up on a post that met -FI_EAGAIN: on shm before libfabric 2.0,
    keep calling `post` (and `poll`) until the provider takes it, for CONNREQ_GRACE
    seconds at most; True if it did. Such a first post to a peer leaves it a connection
    request naming our region and returns -FI_EAGAIN until the peer has mapped us
    (smr_verify_peer, prov/shm/src/smr_ep.c). A peer that reads the request after our
    region is gone fails to map it and, before 2.0, goes on through the NULL region and
    dies (smr_progress_connreq, prov/shm/src/smr_progress.c: 2.0 checks the map). A post
    taken says that the peer has mapped us: the region is then safe to remove."""
    if API_VERSION >= CONNREQ_CHECKED or not getname(ep).startswith(SHM_PREFIX):
        return False
    grace = bounds.stretched(CONNREQ_GRACE)
    with bounds.Deadline(grace, f"the peer did not read our connection request within "
                         f"{grace:g} s") as deadline:
        while time.monotonic() < deadline.at:
            if post():
                return True
            poll()
    return False


def at_address(info, name):
    """A copy of `info` whose endpoint takes the address `name` (from fi_getname), so that a
    new endpoint is reached where an old one was; `info` itself when `name` is None."""
    if name is None:
        return info
    # shm takes an address with its prefix as one to name a new region after, and
    # appends a uid and a count to it; without the prefix, as the very region's name
    # (smr_endpoint_name, prov/shm/src/smr_ep.c)
    name = name.removeprefix(SHM_PREFIX)
    copy = dupinfo(info)
    lib.free(copy.src_addr)  # fi_freeinfo frees what is there
    copy.src_addr = lib.malloc(len(name))
    if copy.src_addr == ffi.NULL:
        raise FabricError("malloc", -lib.FI_ENOMEM)
    ffi.memmove(copy.src_addr, name, len(name))
    copy.src_addrlen = len(name)
    return copy


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


def name_of(info):
    """The -p name that picks `info`: its fabric's where that is one (efa-direct), else its
    provider's (the first of a layered one's, e.g. verbs for verbs;ofi_rxm)."""
    fabric = (provider_of(info).split(";")[0], string(info.fabric_attr.name))
    return next((name for name, pair in NAMED_FABRICS.items() if pair == fabric), fabric[0])


def pick(provider=None, caps=lib.FI_MSG, hmem=False):
    """The fi_info list for `provider`, or for the first of DEFAULT_PROVIDERS that works here.

    With `hmem` (the run puts its buffers in GPU memory) the list must offer
    FI_HMEM too: a provider that refuses it is one line saying why, never a
    list that would register GPU memory as host memory.
    Returns (info, why) where `why` says, for the reader, how it was chosen.
    Raises ValueError with one readable line when nothing fits.
    """
    info, why = _pick(provider, caps)
    if hmem:
        # by the name that picked it: the provider's alone ("efa") would be efa's RDM fabric
        # for an efa-direct entry (FABRICS), without its FI_CONTEXT2
        name = name_of(info)
        try:
            info = getinfo(hints(name, caps=caps | lib.FI_HMEM))
        except FabricError as e:
            if e.rc != -lib.FI_ENODATA:
                raise
            raise ValueError(no_hmem(name)) from None
    return info, why


def no_hmem(provider):
    """Why `provider` may refuse FI_HMEM, and the fix, in one line."""
    base = NAMED_FABRICS.get(provider, (provider.split(";")[0],))[0]
    causes = {
        # prov/efa/src/efa_user_info.c: CUDA not usable by libfabric (API >= 1.18),
        # or P2P disabled, a device without RDMA read, FI_EFA_USE_DEVICE_RDMA=0 (API < 1.18)
        "efa": "it needs a libfabric built with CUDA that finds the GPU (the EFA "
               "installer's, or scripts/build_libfabric.sh), FI_HMEM_P2P_DISABLED and "
               "FI_EFA_USE_DEVICE_RDMA unset (or 1)",
        # prov/verbs/src/verbs_info.c (vrb_hmem_supported): peer memory or dmabuf on mlx5
        "verbs": "it needs nvidia-peermem loaded (modprobe nvidia-peermem) or dmabuf on an "
                 "mlx5 NIC (FI_VERBS_USE_DMABUF unset or 1), and FI_HMEM_P2P_DISABLED unset",
    }
    return (f"{provider} offers no FI_HMEM here, so it cannot move GPU memory: "
            + causes.get(base, "it needs a libfabric built with CUDA "
                               "(scripts/build_libfabric.sh, then LIBFABRIC_PREFIX)"))


def _pick(provider, caps):
    if provider:
        if provider not in NAMED_FABRICS and not set(provider.split(";")) <= KNOWN_PROVIDERS:
            raise ValueError(f"unknown provider '{provider}' (libfabric has: "
                             f"{', '.join(sorted(KNOWN_PROVIDERS))}; and efa's fabric "
                             f"{DIRECT})")
        try:
            return getinfo(hints(provider, caps=caps)), "asked for"
        except FabricError as e:
            if e.rc != -lib.FI_ENODATA:
                raise
            raise ValueError(f"provider '{provider}' has no usable device here "
                             f"(usable: {', '.join(usable(caps)) or 'none'})"
                             + (no_direct(caps) if provider == DIRECT else "")) from None
    for name in DEFAULT_PROVIDERS:
        try:
            info = getinfo(hints(name, caps=caps))
        except FabricError:
            continue
        skipped = DEFAULT_PROVIDERS[:DEFAULT_PROVIDERS.index(name)]
        return info, (f"default: no {'/'.join(skipped)} device here" if skipped else "default")
    raise ValueError(f"none of {', '.join(DEFAULT_PROVIDERS)} is usable here")


def no_direct(caps):
    """Why efa-direct may list nothing: no device, its age, or (with FI_RMA) a device without
    RDMA or unsolicited write receive, whose immediates would each need a posted receive
    (FI_RX_CQ_DATA, which we do not offer: prov/efa/src/efa_user_info.c)."""
    rma = (", and for WRITEs RDMA read, write and unsolicited write receive (-p efa "
           "emulates what is missing)" if caps & lib.FI_RMA else "")
    return (f": efa-direct needs an EFA device and libfabric >= 2.1{rma}; scripts/doctor.py "
            "says what this host has")


def providers():
    """Every provider this libfabric has, with a device here or not (`fi_info -l`)."""
    return sorted({provider_of(i) for i in each(getinfo(ffi.NULL, lib.FI_PROV_ATTR_ONLY))})


def usable(caps=lib.FI_MSG):
    """Names of the providers that offer an RDM endpoint with `caps` on this host."""
    try:
        return sorted({provider_of(i) for i in each(getinfo(hints(caps=caps)))})
    except FabricError:
        return []


# The most a control message may be where the provider names no link MTU (shm, tcp
# have no NIC): 4096 bytes, InfiniBand's largest MTU, so what runs here fits a real NIC.
FALLBACK_MTU = 4096


def max_send(info):
    """The largest SEND the NIC carries in one packet: its link MTU where the provider
    sets one (efa: the device's max_msg_sz, prov/efa/src/efa_prov_info.c; verbs: the
    port's active MTU, prov/verbs/src/verbs_info.c), else FALLBACK_MTU; never more than
    ep_attr->max_msg_size. efa-direct does not split a larger SEND (prov/efa/src/efa_msg.c
    only asserts its length), and efa's RDM fabric and rxm switch protocols for one."""
    return send_limit(lib.tut_nic_mtu(info), info.ep_attr.max_msg_size)


def send_limit(mtu, max_msg_size):
    return min(mtu or FALLBACK_MTU, max_msg_size)


# The most efa's RDM fabric WRITEs at once: it cuts a longer WRITE into segments of
# efa_env.efa_write_segment_size (1 GiB, no variable sets it) or the device's max_rdma_size
# if smaller (2.6.0: prov/efa/src/rdm/efa_rdm_ope.c, efa_rdm_ope_post_remote_write)
EFA_WRITE_SEGMENT = 1 << 30


def max_write(info):
    """The longest WRITE whose immediate the target gets once: ep_attr.max_msg_size, but at
    most EFA_WRITE_SEGMENT on efa's RDM fabric, which lists UINT64_MAX (efa_prov_info.c) and
    puts the immediate on every segment (rdm/efa_rdm_pke.c efa_rdm_pke_write; only an assert
    says no), so that the target counts one WRITE several times; and a WRITE refused half-way
    has its first segments landed, immediates and all, before it is posted again. Under the
    rules of either efa fabric (FABRIC_RULES) the same, whatever fabric runs them.
    efa-direct lists max(MTU, max_rdma_size) itself and splits nothing."""
    efa = name_of(info) == "efa" or rules.MODE in ("efa", DIRECT)
    return min(info.ep_attr.max_msg_size, EFA_WRITE_SEGMENT) if efa else info.ep_attr.max_msg_size


def check_address(info, addr):
    """Raise ValueError unless `addr` has the shape of an address of this provider."""
    what = f"{provider_of(info)} addresses are"
    if info.addr_format == lib.FI_ADDR_STR:
        end = addr.find(b"\0")
        if end < 0:
            raise ValueError(f"{what} NUL-terminated strings like 'fi_shm://...'; this one "
                             f"has no NUL at its end: cut short?")
        if end + 1 < len(addr):
            extra = len(addr) - end - 1
            raise ValueError(f"{what} NUL-terminated strings; {extra} trailing "
                             f"byte{'s' if extra > 1 else ''} after the address's end "
                             f"(the NUL at byte {end})")
        if b"://" not in addr or not addr[:-1].isascii():
            raise ValueError(f"{what} strings like 'fi_shm://...'; this one is not")
    elif info.src_addrlen and len(addr) != info.src_addrlen:
        off = len(addr) - info.src_addrlen
        raise ValueError(f"{what} {info.src_addrlen} bytes; this one is {abs(off)} "
                         f"byte{'s' if abs(off) > 1 else ''} too {'long' if off > 0 else 'short'}")


# --- objects ---------------------------------------------------------------

def _open(call, ctype, fn, *args):
    out = ffi.new(ctype + " **")
    check(call, fn(*args, out, ffi.NULL))
    return out[0]


def fabric_open(info):
    return _open("fi_fabric", "struct fid_fabric", lib.fi_fabric, info.fabric_attr)


_mr_modes = {}  # domain -> the mr_mode of the fi_info it was opened with


def domain_open(fabric, info):
    domain = _open("fi_domain", "struct fid_domain", lib.fi_domain, fabric, info)
    _mr_modes[key(domain)] = info.domain_attr.mr_mode
    return domain


def mr_mode(domain):
    """The mr_mode of the fi_info `domain` was opened with (how to register memory on it)."""
    return _mr_modes[key(domain)]


def endpoint_open(domain, info):
    return _open("fi_endpoint", "struct fid_ep", lib.fi_endpoint, domain, info)


def cq_open(domain, size):
    """A completion queue whose entries carry immediate data (FI_CQ_FORMAT_DATA)."""
    attr = ffi.new("struct fi_cq_attr *", {"size": size, "format": lib.FI_CQ_FORMAT_DATA,
                                           "wait_obj": lib.FI_WAIT_NONE})
    return _open("fi_cq_open", "struct fid_cq", lib.fi_cq_open, domain, attr)


# At least this many operations may be in flight on one endpoint (chapter 07:
# the provider, not our queue, should be the one to say "full").
CONTEXTS = 4096


def in_flight(info):
    """How many operations our queues (OpQueue, common/engine/lane.h) let one endpoint of `info`
    have in flight: four times its transmit queue, as providers take more than
    tx_attr.size before -FI_EAGAIN, and at least CONTEXTS."""
    return max(4 * info.tx_attr.size, CONTEXTS)


def cq_size_for(info, operations=None, incoming=0):
    """CQ entries for an endpoint of `info`: one for each of `operations` (default:
    in_flight(info)), for each receive it can have posted (rx_attr.size) and for each of
    `incoming` peers' WRITEs with an immediate: each takes an entry, and with mode 0 no
    posted receive (FI_RX_CQ_DATA is what would make it take one). efa-direct gives the
    device CQ what we ask and no more (prov/efa/src/efa_cq.c efa_cq_open_ibv_cq; only efa's
    RDM fabric raises it, rdm/efa_rdm_cq.c) and neither guards it
    (docs/efa_fabric_comparison.md): a completion with no room is an overrun."""
    return (in_flight(info) if operations is None else operations) + info.rx_attr.size + incoming


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


def av_insert(av, addr, info=None):
    """Insert one raw address; returns the fi_addr_t to send to. With `info` (the AV's
    provider) the address is one a peer told us, never trusted: ValueError in one line
    unless it has that provider's shape (check_address) and, on shm, names an endpoint
    that exists on this host (shm_peer)."""
    if info is not None:
        check_address(info, addr)
        if info.addr_format == lib.FI_ADDR_STR and provider_of(info) == "shm":
            shm_peer(addr)
        if info.addr_format == lib.FI_SOCKADDR_IN and addr[:2] != AF_INET:
            # the util AV (ofi_ip_av_insertv, prov/util/src/util_av.c, 1.17 to 2.6) sets its
            # address length from each address's family (ofi_sizeofaddr): a family it does
            # not know makes it 0, and every insert after that is "too large for AV" (EINVAL)
            raise ValueError(f"{provider_of(info)} addresses are IPv4 (sockaddr_in); this "
                             "one is not")

    out = ffi.new("fi_addr_t *")
    n = check("fi_av_insert", lib.fi_av_insert(av, addr, 1, out, 0, ffi.NULL))
    if n != 1:
        raise FabricError("fi_av_insert", -lib.FI_EINVAL, "address rejected")
    shm_files.met(bytes(addr))
    return out[0]


AF_INET = socket.AF_INET.to_bytes(2, sys.byteorder)  # sockaddr_in's first field, sin_family
SHM_NAME_MAX = 256  # SMR_NAME_MAX, include/ofi_shm.h (1.17), prov/shm/src/smr_util.h (2.x)


def shm_peer(addr):
    """Refuse (ValueError) an shm address whose region is not in /dev/shm. 1.17's shm takes
    such a name (smr_map_add, prov/util/src/util_shm.c: shm_open's ENOENT is no error)
    and leaves it in its map for good, keyed by the caller's buffer, with a slot a later
    peer is given too (smr_map_del skips a peer it never mapped): the next peer's address
    then finds the other's region, and an fi_av_remove unmaps it under its owner (SIGSEGV
    in smr_sendmsg). A name must be one region's: no folder, within SHM_NAME_MAX."""
    name = addr.removeprefix(SHM_PREFIX).rstrip(b"\0")
    if (not addr.startswith(SHM_PREFIX) or not name or b"/" in name or b"\0" in name
            or len(addr) > SHM_NAME_MAX or not os.path.exists(b"/dev/shm/" + name)):
        raise ValueError(f"no shm endpoint at {addr[:40]!r} on this host")


def av_remove(av, fi_addr):
    check("fi_av_remove", lib.fi_av_remove(av, ffi.new("fi_addr_t *", fi_addr), 1, 0))


def mr_reg(domain, buf, size, access, key, iface=lib.FI_HMEM_SYSTEM, device=0, flags=0,
           dmabuf=None):
    """fi_mr_regattr. `buf` is a cdata pointer or an integer address (e.g. GPU memory).

    `key` is our requested key; providers with FI_MR_PROV_KEY pick their own,
    so always send the peer fi_mr_key(mr), never `key`. `dmabuf`: (fd, offset of
    `buf` in it) to register the memory as a dmabuf (FI_MR_DMABUF; -FI_ENOSYS
    from a binding built against libfabric < 1.20).
    """
    fd, offset = dmabuf or (-1, 0)
    out = ffi.new("struct fid_mr **")
    check("fi_mr_regattr", lib.tut_mr_reg(domain, ffi.cast("void *", buf), size, access, key,
                                          iface, device, flags, fd, offset, out))
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
    """Owns libfabric objects and closes them in reverse order of opening, also on error:
    within bounds.CLOSE_BOUND, or the watchdog ends the process (shm's fi_close spins
    forever on a region lock that a peer killed while holding it)."""

    def __call__(self, obj):
        self.callback(close, obj)
        return obj

    def __exit__(self, *exc):
        bound = bounds.close_bound()
        with bounds.Deadline(bound, f"closing the fabric's objects took more than {bound:.2g} s"):
            return super().__exit__(*exc)


def open_endpoint(own, info, cq_size=None, av_count=16, shm=True):
    """fabric -> domain -> CQ + AV -> endpoint, bound and enabled (taught in chapter 04).

    `own` is a Closer; returns (domain, cq, av, ep). The CQ has room for
    cq_size_for(info) completions unless `cq_size` says otherwise. `shm` False: efa
    may not take its shared-memory path to peers on this host (forbid_shm).
    """
    fabric = own(fabric_open(info))
    domain = own(domain_open(fabric, info))
    cq = own(cq_open(domain, size=cq_size or cq_size_for(info)))
    av = own(av_open(domain, av_count))
    ep = own(endpoint_open(domain, info))
    ep_bind(ep, cq, lib.FI_SEND | lib.FI_RECV)
    ep_bind(ep, av)
    if not shm:
        forbid_shm(ep, info)
    require_gpudirect(ep, info)
    enable(ep)
    return domain, cq, av, ep


def forbid_shm(ep, info):
    """Keep efa off its own shm path (FI_OPT_SHARED_MEMORY_PERMITTED = false; both peers
    must, before fi_enable): on one host, a benchmark then measures the NIC. Other
    providers have no such path; libfabric < 1.21 has no such option (SHM_OFF says so)."""
    if provider_of(info) == "efa" and API_VERSION >= CAN_FORBID_SHM:
        check("fi_setopt(FI_OPT_SHARED_MEMORY_PERMITTED)", lib.tut_forbid_shm(ep))


CAN_FORBID_SHM = 1 << 16 | 21  # the API version that brought the option
# What a benchmark on efa says about it
SHM_OFF = ("efa: its shm path is off (FI_OPT_SHARED_MEMORY_PERMITTED = false): peers on "
           "this host, too, are reached through the NIC" if API_VERSION >= CAN_FORBID_SHM else
           "efa: libfabric < 1.21 cannot turn its shm path off: peers on this host are "
           "reached through shared memory, not the NIC")


def require_gpudirect(ep, info):
    """An efa endpoint for GPU memory (FI_HMEM) must move it by the device itself, or the
    run stops here, before fi_enable, in one line naming what is missing: efa would
    otherwise take GPU memory its device cannot reach and copy every transfer through
    host memory, silently slow (common/fabric/helpers.h, tut_require_gpudirect). verbs
    refuses such memory at registration (prov/verbs/src/verbs_mr.c: ibv_reg_mr fails);
    shm and tcp move GPU memory with CUDA by design."""
    if provider_of(info) != "efa" or not info.caps & lib.FI_HMEM:
        return
    step = ffi.new("int *")
    rc = lib.tut_require_gpudirect(ep, step)
    if rc < 0:
        raise ValueError(f"efa: {NO_GPUDIRECT[step[0]]} ({strerror(rc)}); otherwise efa "
                         "copies every transfer through host memory (run without GPU memory "
                         "to use host memory)")


NO_GPUDIRECT = {  # what each step of tut_require_gpudirect found missing, and the fix
    1: "the EFA device cannot reach GPU memory (GPUDirect RDMA): it needs nvidia-peermem "
       "loaded (sudo modprobe nvidia_peermem) or dmabuf (a kernel and NVIDIA driver that "
       "export GPU memory, FI_HMEM_CUDA_USE_DMABUF not 0), and FI_HMEM_P2P_DISABLED unset",
    2: "efa will not let the device RDMA: FI_EFA_USE_DEVICE_RDMA=0 is set (unset it), or "
       "the EFA device has no RDMA read",
}


# --- data path -------------------------------------------------------------

def posted(call, rc):
    """True when an operation was posted, False on -FI_EAGAIN (try again later)."""
    if rc == -lib.FI_EAGAIN:
        return False
    check(call, rc)
    return True


def msg(buf, size, desc, addr, context, data=0):
    """A struct fi_msg of one buffer, for fi_sendmsg and fi_recvmsg (`data`: the immediate
    a SEND carries with FI_REMOTE_CQ_DATA), and what keeps its pieces alive: hold both
    until the call returned."""
    iov = ffi.new("struct iovec *", {"iov_base": ffi.cast("void *", buf), "iov_len": size})
    descs = ffi.new("void *[1]", [desc])
    message = ffi.new("struct fi_msg *", {"msg_iov": iov, "desc": descs, "iov_count": 1,
                                          "addr": addr, "context": context, "data": data})
    return message, (iov, descs)


def sendmsg(ep, buf, size, desc, dest, context, flags=lib.FI_COMPLETION):
    message, _keep = msg(buf, size, desc, dest, context)
    return posted("fi_sendmsg", lib.fi_sendmsg(ep, message, flags))


def recvmsg(ep, buf, size, desc, src, context, flags=lib.FI_COMPLETION):
    message, _keep = msg(buf, size, desc, src, context)
    return posted("fi_recvmsg", lib.fi_recvmsg(ep, message, flags))


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


IDLE_NAP = (50e-6, 4e-3)  # seconds: an idle wait's first sleep, and its longest
OWN_LOCK_BOUND = 1.0  # seconds our region's lock may stay held in an idle wait (1.x shm)


class OwnLockHeld(TimeoutError):
    """Our endpoint's shm region has stayed locked past OWN_LOCK_BOUND while we waited, idle,
    by a peer killed or stopped in a post to us: no CQ read of this endpoint can return
    until that peer is continued (OwnLock)."""


class OwnLock:
    """Before libfabric 1.18, shm's progress in fi_cq_read takes our own region's spin lock,
    which a peer takes to put a command in our region, and spins until it is free
    (peer_lock.h, tut_own_lock_held). A server's wait without a deadline (for its next
    client: Poller given its endpoint) looks at it before each read: held, it does not read (a live peer frees it within microseconds), and held for
    OWN_LOCK_BOUND its holder is taken as dead or stopped (OwnLockHeld): the server then
    opens its endpoint again at the same address (at_address), a new region, and serves
    the next client. Nothing to see on other providers and versions."""

    def __init__(self, ep):
        self.ep, self.since = ep, None
        self.bound = bounds.stretched(OWN_LOCK_BOUND)

    def held(self):
        """Whether the lock is held now (then do not read the CQ); OwnLockHeld once it has
        been held, at every look, for the bound."""
        if not lib.tut_own_lock_held(self.ep):
            self.since = None
            return False
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elif now - self.since > self.bound:
            raise OwnLockHeld(f"our endpoint's shm region has been locked for {self.bound:g} s "
                              "by a client killed or stopped while it posted to us (libfabric "
                              "< 1.18)")
        return True


class Poller:
    """Reads a CQ and keeps each completion, by operation context, until it is asked for.

    With several operations in flight, completions come in any order; waiting
    for one must not lose the others. Immediate data from a peer's WRITE
    (FI_REMOTE_CQ_DATA) is kept apart, in arrival order.
    """

    def __init__(self, cq, batch=16, ep=None):
        self.cq, self.entries, self.ep = cq, cq_entries(batch), ep  # ep: OwnLock's
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

    def _until(self, ready, timeout, what, idle=False):
        if bounds.signalled() and _interrupting:  # its KeyboardInterrupt was taken for a
            raise KeyboardInterrupt               # client's failure: it still ends the run
        with bounds.armed(timeout, lambda: f"no {what} within {timeout:g} s"):
            self._wait(ready, timeout, what, idle)

    def _wait(self, ready, timeout, what, idle):
        deadline = None if timeout is None else time.monotonic() + timeout
        own_lock = OwnLock(self.ep) if timeout is None and self.ep is not None else None
        nap = 0.0
        while not ready():
            if self._read(own_lock):
                nap = 0.0
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout:g} s")
            if idle:  # nobody to serve: sleep longer each time, the CPU is someone else's
                nap = min(max(2 * nap, IDLE_NAP[0]), IDLE_NAP[1])
                time.sleep(nap)
            else:
                # Let a peer on the same core run. Not time.sleep(0): that is a real
                # sleep (~50 us of timer slack), which cut tcp's throughput by 5x here.
                os.sched_yield()

    def _read(self, own_lock):
        """poll(), unless `own_lock` (an OwnLock, for a wait without a deadline) says our
        region is locked. Such a wait has no deadline, but each read there does: the lock
        taken by a peer killed in the instant between our look and our progress's is the
        watchdog's to end (one line, exit 1), not a hang."""
        if own_lock is None:
            return self.poll()
        if own_lock.held():
            return 0
        with bounds.Deadline(own_lock.bound, "a CQ read did not return: our shm region is locked "
                             "by a client killed or stopped while it posted to us"):
            return self.poll()

    def until_posted(self, post, timeout, what, ep=None):
        """Call `post` until the provider takes the operation (it returns False on
        -FI_EAGAIN: queue full, or tcp still connecting), polling for progress meanwhile.
        `ep`, the endpoint `post` posts on: late, it may still be kept a while
        (connreq_pending)."""
        late = f"no {what} within {timeout:g} s: is the peer running?"
        with bounds.Deadline(timeout, late) as deadline:
            while not post():
                self.poll()
                if time.monotonic() > deadline.at:
                    if ep is None or not connreq_pending(ep, post, self.poll):
                        raise TimeoutError(late)
                    return  # taken after all, once the peer had mapped us

    def send(self, own, domain, ep, data, dest, key, timeout, what, hint=""):
        """SEND the bytes `data` from a buffer registered for it (with requested `key`),
        and wait for its completion; `what` names it in a timeout's message."""
        buf = ffi.new("char[]", data)
        mr = own(mr_reg(domain, buf, len(data), lib.FI_SEND, key=key))
        ctx = ffi.new("struct fi_context2 *")
        self.until_posted(lambda: sendmsg(ep, buf, len(data), mr_desc(mr), dest, ctx), timeout,
                          f"{what} accepted", ep)
        self.wait([ctx], timeout, f"{what} completion{hint}")

    def wait(self, contexts, timeout, what, or_remote_data=False, idle=False):
        """Wait until one of `contexts` completes: returns (the first of them to complete,
        bytes received): messages are handled in the order they came.
        With `or_remote_data`, immediate data arriving first ends the wait: (None, 0).
        `idle`: a server waiting for its next client, which backs off instead of taking
        a core (a blocking wait is no way out on every libfabric: EFA's CQs take a wait
        object from 2.3 on efa-direct and 2.5 on efa, common/fabric/rules.h tut_rules_wait).
        Without a deadline (`timeout` None), a Poller given its endpoint raises OwnLockHeld
        where a dead client's lock would hang the wait."""
        self._until(lambda: any(key(c) in self.done for c in contexts)
                    or (or_remote_data and self.remote_data), timeout, what, idle)
        ctx = next((c for k in self.done for c in contexts if key(c) == k), None)
        return (None, 0) if ctx is None else (ctx, self.done.pop(key(ctx)))

    def wait_all(self, contexts, timeout, what):
        """Wait until every one of `contexts` has completed."""
        self._until(lambda: all(key(c) in self.done for c in contexts), timeout, what)
        for c in contexts:
            del self.done[key(c)]

    def settle(self, contexts, timeout):
        """After a peer's failure: read the CQ until each of `contexts` (operations posted to
        it) has completed or failed and the CQ is empty, for at most bounds.tidy(timeout), so
        that no entry of theirs fails a later wait for someone else and no operation reads
        memory freed after this. Errors are expected here: each is the peer's failure again,
        or, from libfabric 2.5, shm's entry without a context for a copy into a gone peer
        (smr_rma_fast, prov/shm/src/smr_rma.c)."""
        pending = {key(c) for c in contexts}
        timeout = bounds.tidy(timeout)
        # armed as OpQueue.drain is: a provider call that spins on a dead peer's lock (1.17's
        # shm) is the watchdog's to end, not a hang
        with bounds.Deadline(timeout, f"operations to a failed peer did not end within "
                             f"{timeout:g} s") as deadline:
            while time.monotonic() < deadline.at:
                try:
                    if not self.poll() and not pending - self.done.keys():
                        break
                except CompletionError as e:
                    pending.discard(key(e.context))
        for k in pending:
            self.done.pop(k, None)

    def wait_remote_data(self, timeout, what):
        """The immediate data of the next WRITE that carried some."""
        self._until(lambda: self.remote_data, timeout, what)
        return self.remote_data.pop(0)

"""fi_info: the hints we ask with, the list libfabric answers, and the provider a chapter
picks from it; what an entry says about its NIC (largest SEND and WRITE, address shape)."""
import signal

from common.fabric import rules
from common.fabric.binding import API_VERSION, _take_back_signals, ffi, lib
from common.fabric.errors import FabricError, check

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


def tostr(value, kind):
    """libfabric's own spelling of a flag set, e.g. tostr(caps, lib.FI_TYPE_CAPS)."""
    return ffi.string(lib.fi_tostr(ffi.new("uint64_t *", value), kind)).decode()


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
    try:  # the first fi_getinfo loads the providers (see binding._held)
        rc = lib.fi_getinfo(API_VERSION, ffi.NULL, ffi.NULL, flags, hint, out)
    finally:
        _take_back_signals()
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    check("fi_getinfo", rc)
    return ffi.gc(rules.with_twins(out[0]), lib.fi_freeinfo)


def dupinfo(info):
    """fi_dupinfo: a copy of one entry (without its `next`), owned by the caller."""
    copy = lib.fi_dupinfo(info)
    if copy == ffi.NULL:
        raise FabricError("fi_dupinfo", -lib.FI_ENOMEM)
    return ffi.gc(copy, lib.fi_freeinfo)


SHM_PREFIX = b"fi_shm://"  # SMR_PREFIX, prov/shm/src/smr_util.h


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

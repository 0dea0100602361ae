"""One function per fi_* call on libfabric's objects (fabric, domain, CQ, AV, endpoint,
MR) and on the data path, output parameters as return values and errors as exceptions;
Closer, which closes what was opened in reverse order; open_endpoint, chapter 04's steps."""
import contextlib
import os
import socket
import sys

from common import bounds, shm_files
from common.fabric.binding import API_VERSION, ffi, lib
from common.fabric.errors import CompletionError, FabricError, check, strerror
from common.fabric.fi_info import SHM_PREFIX, check_address, provider_of, string


# --- objects ---------------------------------------------------------------

def _open(call, ctype, fn, *args):
    out = ffi.new(ctype + " **")
    check(call, fn(*args, out, ffi.NULL))
    return out[0]


# The objects of a fabric of rxm over tcp (libfabric 1.x's tcp), which are not closed once
# a SIGINT or SIGTERM came: the process is ending, and the kernel closes their sockets.
# Closed then, an endpoint that a peer's WRITE is still arriving on crashes the process:
# tcp flushes the WRITE half received as an error completion with no context
# (tcpx_ep_flush_all_queues, prov/tcp/src/tcpx_ep.c) and rxm's fi_close, reading it,
# dereferences that context (rxm_handle_comp_error, prov/rxm/src/rxm_cq.c, from
# rxm_close_conn): a SIGSEGV in 1.17, a Ctrl-C of chapter 18's decoder mid-request 1
# run in 3. The rest (CQ, AV, domain) stays open with it (closed first, they are busy).
_left_open = set()


def _of_fabric(parent, obj):
    """`obj`, opened on `parent`: one of _left_open's where `parent` is."""
    if key(parent) in _left_open:
        _left_open.add(key(obj))
    return obj


def fabric_open(info):
    fabric = _open("fi_fabric", "struct fid_fabric", lib.fi_fabric, info.fabric_attr)
    if provider_of(info) == "tcp;ofi_rxm":
        _left_open.add(key(fabric))
    return fabric


_mr_modes = {}  # domain -> the mr_mode of the fi_info it was opened with


def domain_open(fabric, info):
    domain = _of_fabric(fabric, _open("fi_domain", "struct fid_domain", lib.fi_domain,
                                      fabric, info))
    _mr_modes[key(domain)] = info.domain_attr.mr_mode
    return domain


def mr_mode(domain):
    """The mr_mode of the fi_info `domain` was opened with (how to register memory on it)."""
    return _mr_modes[key(domain)]


def endpoint_open(domain, info):
    return _of_fabric(domain, _open("fi_endpoint", "struct fid_ep", lib.fi_endpoint, domain,
                                    info))


def cq_open(domain, size):
    """A completion queue whose entries carry immediate data (FI_CQ_FORMAT_DATA)."""
    attr = ffi.new("struct fi_cq_attr *", {"size": size, "format": lib.FI_CQ_FORMAT_DATA,
                                           "wait_obj": lib.FI_WAIT_NONE})
    return _of_fabric(domain, _open("fi_cq_open", "struct fid_cq", lib.fi_cq_open, domain,
                                    attr))


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
    return _of_fabric(domain, _open("fi_av_open", "struct fid_av", lib.fi_av_open, domain,
                                    attr))


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
    return _of_fabric(domain, out[0])


def mr_key(mr):
    return lib.fi_mr_key(mr)


def mr_desc(mr):
    return lib.fi_mr_desc(mr)


def close(obj):
    if isinstance(obj, ffi.CData) and ffi.typeof(obj) is ffi.typeof("struct fi_info *"):
        return  # fi_info lists are freed by the garbage collector (ffi.gc above)
    if key(obj) in _left_open and bounds.signalled():
        return  # see _left_open
    _left_open.discard(key(obj))  # its address may be another object's later
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

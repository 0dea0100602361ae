"""The transfer engine's control endpoint: short messages between engines, SEND and RECV.

A WRITE goes through the C worker; a control message (a request, a report, a check's
verdict) is rare, so Python posts and reaps it, on an endpoint of its own on NIC 0's
domain, with a CQ and an AV of its own that the worker never reads. The engine reads this
CQ in every wait (pump), so messages are taken in whatever the engine waits for.

The endpoint is opened with NIC 0's own fi_info, never the head entry fi_getinfo listed
first: on a ConnectX host rxm opens its connections' verbs endpoints from that fi_info
(prov/rxm/src/rxm_ep.c rxm_open_core_res, rxm_conn.c rxm_open_conn), and verbs refuses an
entry naming another device (prov/verbs/src/verbs_ep.c vrb_open_ep: -FI_EINVAL), so the
first message of every engine whose NIC 0 is not listed first would fail.
"""
import common.fabric as fi
from common.fabric import ffi, lib

RECVS = 16             # control receives kept posted


class Control:
    """An engine's control endpoint on `domain`, opened with `info`, the fi_info that
    domain was opened with: messages of at most `size` bytes (fabric.max_send),
    RECVS receives posted, MR keys from `keys`. `wait(ready, timeout, why)` is the
    engine's wait, which calls pump()."""

    def __init__(self, own, domain, info, size, keys, wait):
        self.size, self.wait = size, wait
        self.cq = own(fi.cq_open(domain, size=fi.cq_size_for(info, 64)))
        self.av = own(fi.av_open(domain, 256))
        self.ep = own(fi.endpoint_open(domain, info))
        fi.ep_bind(self.ep, self.cq, lib.FI_SEND | lib.FI_RECV)
        fi.ep_bind(self.ep, self.av)
        fi.enable(self.ep)
        self._inboxes = ffi.new("char[]", size * RECVS)
        mr = own(fi.mr_reg(domain, self._inboxes, size * RECVS, lib.FI_RECV, next(keys)))
        self._inbox_desc = fi.mr_desc(mr)
        self._recv_ctx = ffi.new("struct fi_context2[]", RECVS)
        for i in range(RECVS):
            self._post_recv(i)
        self._outbox = ffi.new("char[]", size)
        mr = own(fi.mr_reg(domain, self._outbox, size, lib.FI_SEND, next(keys)))
        self._outbox_desc, self._send_ctx = fi.mr_desc(mr), ffi.new("struct fi_context2 *")
        self._sent, self._messages = False, []
        self._entries = fi.cq_entries(16)

    def _post_recv(self, i):
        at = self._inboxes + i * self.size
        if not fi.recvmsg(self.ep, at, self.size, self._inbox_desc, lib.FI_ADDR_UNSPEC,
                          self._recv_ctx + i):
            raise fi.FabricError("fi_recvmsg", -lib.FI_EAGAIN)

    def send(self, peer, data, imm, timeout):
        """SEND `data` (bytes, at most `size`) with immediate `imm` to `peer`'s control
        endpoint (peer.control, its address in our AV); returns once it completed."""
        ffi.memmove(self._outbox, data, len(data))
        msg, _keep = fi.msg(self._outbox, len(data), self._outbox_desc, peer.control,
                            self._send_ctx, imm)
        self._sent = False
        self.wait(lambda: fi.posted("fi_sendmsg", lib.fi_sendmsg(
            self.ep, msg, lib.FI_COMPLETION | lib.FI_REMOTE_CQ_DATA)), timeout,
            lambda: f"no control message to peer {peer.index} could be sent within "
                    f"{timeout:g} s (the provider's queue stayed full): is the peer "
                    "still running?")
        self.wait(lambda: self._sent, timeout,
                  lambda: f"a control message to peer {peer.index} did not complete within "
                          f"{timeout:g} s: is the peer still running?")

    def recv(self, timeout):
        """(the immediate it carried, or None, the bytes) of the next message."""
        self.wait(lambda: self._messages, timeout,
                  lambda: f"no control message within {timeout:g} s")
        return self._messages.pop(0)

    def pump(self):
        """Read the CQ: our SEND's completion, messages that came."""
        n = fi.cq_read(self.cq, self._entries)
        for e in self._entries[0:n]:
            if fi.key(e.op_context) == fi.key(self._send_ctx):
                self._sent = True
                continue
            i = fi.key(e.op_context) - fi.key(self._recv_ctx)
            i //= ffi.sizeof("struct fi_context2")
            at = self._inboxes + i * self.size
            self._messages.append((e.data if e.flags & lib.FI_REMOTE_CQ_DATA else None,
                                   ffi.buffer(at, e.len)[:]))
            self._post_recv(i)
        return n

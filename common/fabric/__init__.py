"""A thin Python face on libfabric: one function per fi_* call, errors as exceptions.

Every function here is the libfabric call of the same name with its output
parameters turned into return values and its negative return codes turned
into FabricError. Nothing is hidden: chapter 04 calls them one by one, in
the order libfabric wants them.

    with Closer() as own:                  # closes everything in reverse order
        fabric = own(fabric_open(info))
        domain = own(domain_open(fabric, info))
        ...

binding: the binding loaded, signals held meanwhile, which libfabric it is; errors:
FabricError; fi_info: hints, fi_getinfo and the provider a chapter picks; calls: a function
per fi_* call on objects and the data path, Closer, open_endpoint; poller: waiting for
completions (Poller). This package re-exports the names used elsewhere; a test that replaces
one of them for the code of this package patches the module that reads it
(tests/support/fake_info.py patch), as a copy here is not read.
"""
from common.fabric.binding import (API_VERSION, ffi, lib, libfabrics, loaded_from, loads_from,
                                   prefix_mismatch, stop_interrupting, version)
from common.fabric.errors import CompletionError, FabricError, check, strerror
from common.fabric.fi_info import (DEFAULT_PROVIDERS, DIRECT, DIRECT_MODE, EFA_HW_COUNTERS,
                                   EFA_RINGS_QUEUED, FABRICS, FALLBACK_MTU, KNOWN_PROVIDERS, MODE,
                                   MR_MODE, SHM_PREFIX, at_address, check_address, dupinfo, each, getinfo,
                                   hints, max_send, max_write, name_of, pick, provider_of,
                                   providers, send_limit, string, tostr, usable)
from common.fabric.calls import (CAN_FORBID_SHM, SHM_OFF, Closer, Inbox, av_insert, av_open,
                                 av_remove, close, cq_entries, cq_open, cq_read, cq_size_for,
                                 domain_open, enable, endpoint_open, ep_bind, fabric_open,
                                 forbid_shm, getname, in_flight, key, mr_desc, mr_key, mr_mode,
                                 mr_reg, msg, native_error, open_endpoint, posted, recvmsg,
                                 remote_base, require_gpudirect, sendmsg, shm_peer, writemsg)
from common.fabric.poller import (IDLE_NAP, OWN_LOCK_BOUND, EndpointDeaf, OwnLock,
                                  OwnLockHeld, Poller, RequesterGone, connreq_pending)

__all__ = ["API_VERSION", "ffi", "lib", "libfabrics", "loaded_from", "loads_from",
           "prefix_mismatch", "stop_interrupting", "version", "CompletionError", "FabricError",
           "check", "strerror", "DEFAULT_PROVIDERS", "DIRECT", "DIRECT_MODE", "EFA_HW_COUNTERS",
           "EFA_RINGS_QUEUED", "FABRICS", "FALLBACK_MTU", "KNOWN_PROVIDERS", "MODE", "MR_MODE",
           "at_address", "check_address", "dupinfo", "each", "getinfo", "hints", "max_send",
           "max_write", "name_of", "pick", "provider_of", "providers", "send_limit", "string",
           "tostr", "usable", "CAN_FORBID_SHM", "SHM_OFF", "Closer", "Inbox", "av_insert",
           "av_open", "av_remove", "close", "cq_entries", "cq_open", "cq_read", "cq_size_for",
           "domain_open", "enable", "endpoint_open", "ep_bind", "fabric_open", "forbid_shm",
           "getname", "in_flight", "key", "mr_desc", "mr_key", "mr_mode", "mr_reg", "msg",
           "native_error", "open_endpoint", "posted", "recvmsg", "remote_base",
           "require_gpudirect", "sendmsg", "shm_peer", "writemsg", "SHM_PREFIX", "IDLE_NAP",
           "OWN_LOCK_BOUND", "EndpointDeaf", "OwnLock", "OwnLockHeld", "Poller", "RequesterGone",
           "connreq_pending"]

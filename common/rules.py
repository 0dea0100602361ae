"""FABRIC_RULES=efa|verbs: run the chapters on shm or tcp as an EFA device or a verbs NIC
would let them (tests/test_rules.py does, for chapters 04-16).

The checks themselves are in C (common/rules.h), compiled into every module of the
binding, so that the C workers' calls are checked like Python's. Here is what
reaches them from common/fabric.py: the hints leave out FI_MR_VIRT_ADDR (efa and
verbs have it, but code must also work with offsets, as tcp here wants them), every
fi_info entry gets a twin of another fabric and address format for the same domain
name, as efa and efa-direct share one (prov/efa/src/efa_domain.h; verbs lists IPv4 and
IPv6), and a broken rule's return code is said in words.

    FABRIC_RULES=efa python scripts/pair.py 07 -p shm -- --iters 3000 --pages 0-63
"""
import os
import sys

from common._fabric import ffi, lib

MODES = ("efa", "verbs")
MODE = os.environ.get("FABRIC_RULES") or None
if MODE not in (None, *MODES):
    sys.exit(f"FABRIC_RULES={MODE}: expected one of {', '.join(MODES)}")
TWIN = "-twin"  # ends a twin's fabric name (RULES_TWIN in common/rules.h)


def restrict(hint):
    """Hints as the rules have them: without FI_MR_VIRT_ADDR, so that shm too takes offsets."""
    if MODE:
        hint.domain_attr.mr_mode &= ~lib.FI_MR_VIRT_ADDR


def text(rc):
    """The rule that a return code says was broken, or None."""
    said = lib.tut_rules_text(rc)
    return f"rules of {MODE}: {ffi.string(said).decode()}" if said != ffi.NULL else None


def with_twins(head):
    """`head`, each entry followed by its twin (only with FABRIC_RULES): the same domain,
    another fabric name and address format. Opening a twin breaks a rule."""
    if not MODE:
        return head
    info = head
    while info != ffi.NULL:
        twin = lib.fi_dupinfo(info)
        if twin == ffi.NULL:
            raise MemoryError("fi_dupinfo")
        name = ffi.string(info.fabric_attr.name).decode() if info.fabric_attr.name else ""
        lib.free(twin.fabric_attr.name)
        twin.fabric_attr.name = lib.strdup((name + TWIN).encode())  # freed by fi_freeinfo
        twin.addr_format = (lib.FI_SOCKADDR_IN6 if info.addr_format != lib.FI_SOCKADDR_IN6
                            else lib.FI_SOCKADDR_IN)
        twin.next, info.next = info.next, twin
        info = twin.next
    return head

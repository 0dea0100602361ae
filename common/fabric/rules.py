"""FABRIC_RULES=efa|efa-direct|verbs: the chapters on shm or tcp, held to what an EFA device
(through efa's RDM fabric, or efa-direct's one work request per call) or a verbs NIC accepts
(tests/test_fabric_rules.py runs chapters 04-16, 18 and 19 so; 18 and 19 under efa's two
rule sets).

Each call is checked in C (common/fabric/rules.h), compiled into every module of the binding,
so the C workers are checked like Python. This module does the rest, for
common/fabric/fi_info.py: it holds fi_getinfo's hints to what efa-direct lists entries for
(tut_rules_hints in rules.h), then leaves FI_MR_VIRT_ADDR out of them (efa and verbs have it,
but the path with offsets must hold too: tcp here takes offsets, and so does shm
without the bit), follows every fi_info entry with a twin of another fabric and
address format for the same domain name (efa and efa-direct share one,
prov/efa/src/efa_domain.h; verbs has one per IP address of the NIC, verbs_info.c
vrb_getifaddrs), and says a broken rule's return code in words.

    FABRIC_RULES=efa .venv/bin/python scripts/pair.py 06 -p shm
    .venv/bin/python -m pytest tests/test_fabric_rules.py     # 04-16 under both, each rule broken
"""
import os
import sys

from common._fabric import ffi, lib

MODES = ("efa", "efa-direct", "verbs")
MODE = os.environ.get("FABRIC_RULES") or None
if MODE not in (None, *MODES):
    sys.exit(f"FABRIC_RULES={MODE}: expected one of {', '.join(MODES)}")
TWIN = "-twin"  # ends a twin's fabric name (RULES_TWIN in common/fabric/rules.h)
VNIC = "~vnic"  # in a virtual NIC's domain name (RULES_VNIC in common/fabric/rules.h)


def restrict(hint):
    """Hints as the rules have them: without FI_MR_VIRT_ADDR, so that shm too takes offsets.
    Returns 0, or the code of a broken rule (hints efa-direct would list nothing for)."""
    if not MODE or hint == ffi.NULL:
        return 0
    broken = lib.tut_rules_hints(hint)
    hint.domain_attr.mr_mode &= ~lib.FI_MR_VIRT_ADDR
    return broken


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


def virtual_nics(head, count):
    """`count` virtual NICs of `head`'s provider, each one more domain of it. Without
    FABRIC_RULES each is `head` itself; with them, a copy of it whose domain name ends in
    VNIC and its index, so that they differ, from each other and from the head entry, as a
    host's NICs do (verbs keeps each endpoint to its own NIC's entry: rules.h, RULE_DOMAIN).
    The provider itself is given the name without the suffix."""
    if not MODE:
        return [head] * count
    name = ffi.string(head.domain_attr.name).decode() if head.domain_attr.name else ""
    nics = []
    for i in range(count):
        copy = lib.fi_dupinfo(head)
        if copy == ffi.NULL:
            raise MemoryError("fi_dupinfo")
        nics.append(ffi.gc(copy, lib.fi_freeinfo))
        lib.free(copy.domain_attr.name)
        copy.domain_attr.name = lib.strdup(f"{name}{VNIC}{i}".encode())  # freed by fi_freeinfo
    return nics

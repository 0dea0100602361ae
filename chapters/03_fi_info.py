"""Chapter 03 - fi_info: what does this libfabric offer on this host?

What you will learn: fi_getinfo answers "which (provider, domain) pairs can
give me an endpoint with these capabilities?". A domain is one NIC (or, for
shm and tcp, one local stand-in for it); its fi_info says how memory must be
registered (mr_mode), what the endpoint can do (caps), how fast the link is,
and where the NIC sits on the PCIe bus - the facts chapters 06-15 build on.
The first line says which libfabric the binding loaded: Debian's 1.17, or one
of scripts/build_libfabric.sh (2.6.0 by default, 2.1.0 on request); what 2.x
changes is in the cell "libfabric 1.x and 2.x" below.

New: the series' chapters 0-2 are prose, so this is the first program. It
opens nothing yet; it only asks, as the fi_info tool does.

    .venv/bin/python chapters/03_fi_info.py                     # everything, one line each
    .venv/bin/python chapters/03_fi_info.py -p shm -v           # one provider, in detail
    .venv/bin/python chapters/03_fi_info.py --ep-type rdm --caps FI_RMA,FI_HMEM

Transcripts: results/03_fi_info/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## libfabric 1.x and 2.x
# 2.x wants hints from fi_allocinfo, names tcp's own RDM endpoint "tcp" (1.x:
# "tcp;ofi_rxm") and, from 2.1, lists each efa device twice, fabric "efa-direct"
# first, then "efa" (prov/efa/src/efa_prov.c; `-p efa-direct` takes the first,
# chapter 07); 2.5 rewrote shm. README's "Using another libfabric" says what that
# changes in 06-07.

# %% [markdown]
# ## Motivation
# Before opening anything, ask libfabric what it can do. Same question as the
# `fi_info` tool; our list of (provider, domain) pairs must match its list.
# The fabric column tells one provider's ways to a NIC apart: efa's "efa-direct"
# (the device alone, one work request per call) and "efa" (RDM, efa's own
# protocols on top), each with its own mode and limits (-v shows them).

# %%
from common import cli
from common.fabric import ffi, lib
import common.fabric as fi

EP_TYPES = {"rdm": lib.FI_EP_RDM, "msg": lib.FI_EP_MSG, "dgram": lib.FI_EP_DGRAM}
ALL = 0xFFFF_FFFF_FFFF_FFFF
# Like the fi_info tool: accept every mode and every mr_mode except the two
# that libfabric 2.0 removed (FI_MR_BASIC, FI_MR_SCALABLE).
ALL_MR_MODES = ~3


def parse_caps(text):
    """'FI_RMA,FI_HMEM' or 'rma,hmem' -> bit mask."""
    mask = 0
    for name in filter(None, text.replace("|", ",").split(",")):
        name = name.strip().upper()
        name = name if name.startswith("FI_") else "FI_" + name
        if not hasattr(lib, name):
            raise cli.UsageError(f"unknown capability '{name}'")
        mask |= getattr(lib, name)
    return mask


# %% [markdown]
# ## Code

# %%
def describe(info, verbose):
    speed = lib.tut_nic_speed(info)
    pci = ffi.new("char[16]")
    bus = ffi.string(pci).decode() if lib.tut_nic_pci(info, pci, len(pci)) else "-"
    gbps = f"{speed / 1e9:.0f}" if speed else "-"
    line = (f"{fi.provider_of(info):<14} {fi.string(info.fabric_attr.name):<16} "
            f"{fi.string(info.domain_attr.name):<12} "
            f"{fi.tostr(info.ep_attr.type, lib.FI_TYPE_EP_TYPE):<11} {gbps:>7} {bus}")
    if not verbose:
        return line
    return "\n".join([line,
                      f"    caps:     {fi.tostr(info.caps, lib.FI_TYPE_CAPS)}",
                      f"    mode:     {fi.tostr(info.mode, lib.FI_TYPE_MODE)}",
                      f"    mr_mode:  {fi.tostr(info.domain_attr.mr_mode, lib.FI_TYPE_MR_MODE)}",
                      f"    address:  {fi.tostr(info.addr_format, lib.FI_TYPE_ADDR_FORMAT)}",
                      f"    max msg:  {info.ep_attr.max_msg_size}, inject: "
                      f"{info.tx_attr.inject_size}, rma iov: {info.tx_attr.rma_iov_limit}, "
                      f"cq data: {info.domain_attr.cq_data_size} bytes"])


def main():
    p = cli.parser(__doc__)
    p.add_argument("--ep-type", choices=sorted(EP_TYPES), help="endpoint type")
    p.add_argument("--caps", default="", help="required capabilities, e.g. FI_RMA,FI_HMEM")
    p.add_argument("-v", "--verbose", action="store_true", help="caps, modes and limits too")
    args = p.parse_args()
    caps = parse_caps(args.caps)
    if args.provider and not set(args.provider.split(";")) <= fi.KNOWN_PROVIDERS:
        fi.pick(args.provider)  # raises the 'unknown provider' line

    hint = fi.hints(args.provider, ep_type=EP_TYPES.get(args.ep_type, lib.FI_EP_UNSPEC),
                    caps=caps, mr_mode=ALL_MR_MODES, mode=ALL, fabric=False)
    hint.domain_attr.mode = ALL
    try:
        head = fi.getinfo(hint)
    except fi.FabricError as e:
        if e.rc != -lib.FI_ENODATA:
            raise
        print("nothing here matches (fi_getinfo: -FI_ENODATA)")
        return 1
    major, minor = fi.version()
    print(f"libfabric {major}.{minor} (API {lib.FI_MAJOR_VERSION}.{lib.FI_MINOR_VERSION})")
    print(f"{'provider':<14} {'fabric':<16} {'domain':<12} {'endpoint':<11} {'Gbps':>7} nic bus")
    infos = list(fi.each(head))
    for info in infos:
        print(describe(info, args.verbose))
    pairs = {(fi.provider_of(i), fi.string(i.domain_attr.name)) for i in infos}
    providers = len({p for p, _ in pairs})
    print(f"{plural(len(infos), 'entry', 'entries')}: {plural(providers, 'provider')}, "
          f"{plural(len(pairs), '(provider, domain) pair')}")


def plural(n, one, many=None):
    return f"{n} {one if n == 1 else many or one + 's'}"


if __name__ == "__main__":
    cli.run(main)

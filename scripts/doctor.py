"""The doctor: what will work on this machine and what will not, one line each, with the fix.

Run it first on a fresh p5 or ConnectX box (in a container: inside it):

    .venv/bin/python scripts/doctor.py

Each line starts with
    ok    works
    --    not here, and nothing to fix (a laptop has no GPU and no RDMA NIC)
    FIX   will not work as it stands: the line ends with what to do
Exit code: 0 when no line says FIX, 1 when one does, 2 for bad arguments.

What it looks at, and why:
- libfabric: the library the binding loads (version, path). Where the AWS EFA
  installer put one (/opt/amazon/efa), that is the one to use: setup.sh picks
  it by default.
- binding: the libfabric the binding was compiled against; one older at run time
  refuses its API version (fi_getinfo: -FI_ENOSYS, src/fabric.c).
- one libfabric: after loading what a serving engine would (torch, NCCL's net
  plugin), more than one libfabric.so in the process (/proc/self/maps), as when
  aws-ofi-nccl brings its own: efa can then list nothing, or NCCL fall back to TCP.
- efa, verbs: the NICs on the PCI bus (sysfs: Amazon 1d0f:efa*, Mellanox 15b3),
  the kernel's RDMA devices for them (/sys/class/infiniband), the provider in
  this libfabric (`fi_info -l`) and a device it can open (fi_getinfo). The
  first layer that is missing is the one to fix. For efa, the fabrics: from
  libfabric 2.0 efa-direct (the device alone) is listed beside efa (RDM, with
  libfabric's own protocols on top; prov/efa/src/efa_prov.c).
- fabric: per chapter, the provider, fabric and domain its hints (caps, mr_mode)
  pick here, by the chapters' own fi.pick; efa 2.x lists efa-direct before efa
  (prov/efa/src/efa_prov.c) to hints with mode FI_CONTEXT2 (prov/util/src/util_attr.c
  drops it otherwise), -p efa takes efa, -p efa-direct efa-direct (common/fabric FABRICS).
- RDMA read/write on efa: efa-direct claims FI_RMA only when the device does
  RDMA read, RDMA write and unsolicited-write receive
  (prov/efa/src/efa_prov_info.c); without them, efa's RDM fabric emulates a
  WRITE with messages, and FI_EFA_USE_DEVICE_RDMA=0 stops it using the
  device's RDMA even where there is some (prov/efa/src/rdm/efa_rdm_ep_fiops.c).
- GPU memory: the GPUs (CUDA, through cupy; NVIDIA devices on the PCI bus),
  then a real registration of GPU memory with each usable provider, which
  needs a libfabric built with CUDA and FI_HMEM granted by the provider.
- dmabuf or nvidia-peermem: how a NIC reaches GPU memory. dmabuf needs CUDA's
  CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED and libfabric >= 1.20 (FI_MR_DMABUF);
  otherwise the NIC's driver pins GPU pages through nvidia_peermem
  (/sys/module/nvidia_peermem). Where GPUDirect RDMA writes are not ordered for
  the GPU (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING), a NIC's
  writes must be flushed before a kernel reads them.
- dmabuf context: the dmabuf export needs a current CUDA context on the thread
  that registers (cuCtxGetCurrent); without one it fails, and efa's registration
  with it (EFAULT, or "Operation not supported": prov/efa/src/efa_mr.c).
- GPU-NIC-NUMA map: chapter 08's layout (common/engine/topo.py): how many NICs each
  GPU gets and whether any sits on another NUMA node than its GPU; where this process
  sees only some GPUs (Slurm --gpus-per-task, torchrun, CUDA_VISIBLE_DEVICES), the NICs
  each of them drives, the same as with all seen.
- instance: which EFA instance the NICs and their link speeds make (p5: 32 x 100 Gbps,
  p5en: 16 x 200, p6-b200: 8 x 400, p6-b300: 16 x 400); fewer than one has, said.
- GPU memory on efa: the endpoint is opened as the chapters open it, which requires
  GPUDirect (common/fabric require_gpudirect): efa would otherwise register GPU memory
  with a made-up key and copy every transfer through host memory (bounce buffers).
- FI_MORE, HW counters, CQ wait (efa): what the libfabric loaded changes. efa's own
  fabric rings no doorbell for a WRITE it queued with FI_MORE before 2.7 (chapter 14
  leaves FI_MORE off there); from 2.7 efa's counters are the device's by default
  (FI_EFA_USE_HW_CNTR), and a counter makes no progress: a CQ must still be read;
  blocking CQ reads: efa-direct from 2.3, efa from 2.5.
- --chapter N: efa or efa-direct for that chapter, and why, on this device and libfabric.
- locked memory: efa and verbs pin every registered buffer, which counts
  against `ulimit -l` unless the process has CAP_IPC_LOCK; chapter 07
  registers 2 x 1 GiB. shm and tcp pin nothing.
- huge pages: efa takes its internal buffers from huge pages where there are
  some, from normal pages otherwise (prov/util/src/util_buf.c): a small cost.
- GDRCopy (/dev/gdrdrv, libgdrapi): a libfabric built with it copies small
  messages to and from GPU memory through a CPU mapping instead of
  cudaMemcpy. The MoE chapters' proxy needs none: the stamps it polls live in
  pinned host memory.

    .venv/bin/python scripts/doctor.py --chapter 14            # and which EFA fabric for 14
    .venv/bin/python scripts/doctor.py --sysfs DIR --dev DIR   # a described machine (tests)
"""
import ctypes.util
import importlib.util
import os
import re
import resource
import sys
from pathlib import Path

try:
    from common import usage
except ModuleNotFoundError:  # a Python the project is not installed in (setup.sh not run)
    sys.exit(f"FIX  project        not installed in {sys.executable}: bash scripts/setup.sh, "
             "then .venv/bin/python scripts/doctor.py")
from common.engine import topo  # noqa: E402
import common.fabric as fabric  # noqa: E402
from common.gpu import cuda_driver  # noqa: E402
from common.fabric import libfabrics  # noqa: E402
from common.model.instances import INSTANCES  # noqa: E402

read = topo._read  # a file's text, stripped, or `default` where there is none

OK, ABSENT, FIX = "ok", "--", "FIX"
AMAZON, MELLANOX = "0x1d0f", "0x15b3"
EFA_INSTALLER = Path("/opt/amazon/efa")
CAP_IPC_LOCK = 14
REAL_NICS = {"efa": "EFA", "verbs": "RDMA (ConnectX)"}


class Machine:
    """Where the doctor reads the machine from: sysfs, /proc/meminfo and /dev (fakes in the
    tests). What the process itself is (/proc/self) is always read from /proc."""

    def __init__(self, sysfs="/sys", proc="/proc", dev="/dev"):
        self.sysfs, self.proc, self.dev = Path(sysfs), Path(proc), Path(dev)

    def nics_on_bus(self, provider):
        if provider == "efa":
            return topo.pci_devices(self.sysfs, AMAZON, device="0xefa")
        # network controllers: InfiniBand, Ethernet
        return topo.pci_devices(self.sysfs, MELLANOX, classes=("0x02",))

    def rdma_devices(self, buses):
        """The kernel's RDMA devices (/sys/class/infiniband) that sit on `buses`."""
        return [d.name for d in sorted((self.sysfs / "class" / "infiniband").glob("*"))
                if os.path.basename(os.path.realpath(d / "device")) in buses]

    def meminfo(self):
        text = read(self.proc / "meminfo", "")
        return {k: int(v) for k, v in re.findall(r"^(\w+):\s+(\d+)", text, re.MULTILINE)}


def offered(fi, provider, caps=None):
    """fi_getinfo for `provider` with the chapters' hints, or None where it offers nothing."""
    try:
        return fi.getinfo(fi.hints(provider, caps=caps or fi.lib.FI_MSG | fi.lib.FI_RMA))
    except fi.FabricError:
        return None


# --- libfabric ---------------------------------------------------------------

def libfabric(machine):
    """(line, the binding or None)."""
    try:
        import common.fabric as fi
    except SystemExit as e:  # the binding is not built: common.fabric says how to build it
        return (FIX, "libfabric", str(e.code)), None
    path = loaded_from()
    text = f"{'%d.%d' % fi.version()} loaded from {path}"
    if EFA_INSTALLER.is_dir() and path.startswith(("/usr/", "/lib")):  # the system's
        return (FIX, "libfabric", f"{text}, not the EFA installer's in {EFA_INSTALLER}: "
                f"bash scripts/setup.sh (uses it by default)"), fi
    return (OK, "libfabric", text), fi


def loaded_from():
    """The path of the libfabric.so this process has loaded ('?' if none)."""
    return fabric.loaded_from() or "?"




def binding_line(fi, path, built=None):
    """The libfabric the binding was compiled against (its headers' FI_MAJOR/MINOR_VERSION,
    `built` in the tests) beside the one loaded: an older one refuses every fi_getinfo of
    the newer API with -FI_ENOSYS (src/fabric.c, "Requested version is newer than
    library"), so nothing after this line could be trusted."""
    built = built or (fi.lib.FI_MAJOR_VERSION, fi.lib.FI_MINOR_VERSION)
    loaded = fi.version()
    text = f"built against libfabric {'%d.%d' % built}, {'%d.%d' % loaded} loaded"
    if loaded >= built:
        return (OK, "binding", text)
    prefix = Path(path).parent.parent
    return (FIX, "binding", f"{text}: an older libfabric refuses the binding's API version "
            f"(fi_getinfo: -FI_ENOSYS); build it against the one loaded (LIBFABRIC_PREFIX="
            f"{prefix} bash scripts/setup.sh), or load the {'%d.%d' % built} one "
            "(LD_LIBRARY_PATH to its lib)")


def load_like_a_serving_engine():
    """What a serving engine loads beside us, loaded here: torch (with it, NCCL) where it is
    installed, then NCCL's net plugin, found as NCCL finds it at its first communicator
    (NCCL_NET_PLUGIN, else libnccl-net.so: src/plugin/plugin_open.cc); aws-ofi-nccl's brings
    its own libfabric. The names of what loaded."""
    loaded = []
    if importlib.util.find_spec("torch"):
        try:
            import torch  # noqa: F401 (loaded for what it maps)
            loaded.append("torch")
        except Exception as e:  # a broken torch is the engine's problem: say it, go on
            loaded.append(f"no torch (importing it: {type(e).__name__})")
    name = os.environ.get("NCCL_NET_PLUGIN", "")
    for plugin in ([f"libnccl-net-{name}.so", name] if name else ["libnccl-net.so"]):
        try:
            ctypes.CDLL(plugin, mode=os.RTLD_LOCAL | os.RTLD_NOW)
        except OSError:
            continue
        loaded.append(plugin)
        break
    return loaded


def libfabric_copies_line(ours, mapped, loaded):
    """One libfabric in the process, or the paths of them all: two give efa's fi_getinfo
    an empty list or NCCL a silent fall back to TCP. `ours`: the binding's; `mapped`:
    libfabrics() after load_like_a_serving_engine(), which loaded `loaded`."""
    beside = f"with {', '.join(loaded)} loaded" if loaded else \
        "nothing else here loads one (no torch, no NCCL net plugin)"
    others = [p for p in mapped if p != ours]
    if not others:
        return (OK, "one libfabric", f"{ours} alone in this process, {beside}")
    one = next((p for p in mapped if Path(p).is_relative_to(EFA_INSTALLER)), others[0])
    return (FIX, "one libfabric", f"{len(mapped)} in this process, {beside}: {ours} (the "
            f"binding's) and {', '.join(others)}: efa can answer fi_getinfo with an empty "
            f"list, or NCCL fall back to TCP; use one: LIBFABRIC_PREFIX="
            f"{Path(one).parent.parent} bash scripts/setup.sh, and LD_LIBRARY_PATH="
            f"{Path(one).parent}")


def nic_lines(fi, machine, provider):
    """One line for efa or verbs: the first layer missing, or what works. (line, fi_info or None)"""
    kind = REAL_NICS[provider]
    buses = machine.nics_on_bus(provider)
    kernel = machine.rdma_devices(buses)
    built = provider in fi.providers()
    info = offered(fi, provider, fi.lib.FI_MSG)  # efa-direct without RDMA is listed too
    if info is not None:
        return (OK, provider, describe(fi, info, provider)), info
    if not buses and not kernel:
        has = f"has the {provider} provider" if built else f"has no {provider} provider either"
        return (ABSENT, provider, f"no {kind} NIC on this machine (this libfabric {has})"), None
    where = f"{len(buses)} {kind} NICs on the PCI bus"
    if not kernel:
        driver = ("the EFA driver: the AWS EFA installer" if provider == "efa"
                  else "the mlx5_ib driver: modprobe mlx5_ib (or the MLNX_OFED/DOCA installer)")
        return (FIX, provider, f"{where}, but the kernel has no RDMA device for them: "
                f"install {driver}"), None
    if not built:
        build = ("bash scripts/build_libfabric.sh, then LIBFABRIC_PREFIX=.deps/libfabric "
                 "bash scripts/setup.sh")
        use = (f"LIBFABRIC_PREFIX={EFA_INSTALLER} bash scripts/setup.sh (the EFA installer's), "
               f"or {build}" if provider == "efa" else build)
        return (FIX, provider, f"{where} ({', '.join(kernel)}), but this libfabric has no "
                f"{provider} provider: {use}"), None
    lib = "libefa" if provider == "efa" else "libmlx5"
    return (FIX, provider, f"{where} ({', '.join(kernel)}), but libfabric opens none of "
            f"them: the process needs /dev/infiniband/uverbs* (in a container: --device for "
            f"each) and rdma-core's {lib}"), None


def describe(fi, info, provider):
    entries = list(fi.each(info))
    domains = sorted({fi.string(i.domain_attr.name) for i in entries})
    fabrics = sorted({fi.string(i.fabric_attr.name) for i in entries})
    shown = " ".join(domains[:4]) + (" ..." if len(domains) > 4 else "")
    text = f"{len(domains)} domains ({shown}); fabrics: {', '.join(fabrics)}"
    if provider == "efa":
        return text
    formats = sorted({fi.tostr(i.addr_format, fi.lib.FI_TYPE_ADDR_FORMAT) for i in entries})
    return f"{text}; address formats: {', '.join(formats)}; RDMA read and write by the NIC"


def direct_entries(fi, info):
    """The efa-direct entries of the fi_info list `info`."""
    return [i for i in fi.each(info) if fi.string(i.fabric_attr.name) == "efa-direct"]


def rdma_write_line(fi, info):
    """efa only: does the device do RDMA itself, or does efa's RDM fabric emulate it?"""
    direct = direct_entries(fi, info)
    if os.environ.get("FI_EFA_USE_DEVICE_RDMA", "").lower() in ("0", "false", "no", "off"):
        return (FIX, "RDMA write", "FI_EFA_USE_DEVICE_RDMA is off: efa emulates RDMA with "
                "messages; unset FI_EFA_USE_DEVICE_RDMA")
    if not direct:
        return (ABSENT, "RDMA write", "this libfabric has no efa-direct fabric (from 2.0), so "
                "it does not show whether the device does RDMA write")
    if direct_rma(fi, info):
        return (OK, "RDMA write", "the device does RDMA read, write and unsolicited-write "
                "receive (efa-direct claims FI_RMA)")
    return (ABSENT, "RDMA write", "the device lacks RDMA read, write or unsolicited-write "
            "receive (efa-direct has no FI_RMA): efa's RDM fabric emulates WRITEs with "
            "messages, slower")


# What each chapter asks fi_getinfo for, with fi.hints' mr_mode (fi.MR_MODE), through
# fi.pick (cli.peer) when no -p is given: 04-05 their messages, 08 chapter 08's FI_RMA,
# the rest CAPS (06, 07, common/engine/multinet.py, common/moe, common/transfer).
CHAPTER_CAPS = (("chapters 04-05", "FI_MSG"), ("chapters 06-07, 09-19", "FI_MSG FI_RMA"),
                ("chapter 08", "FI_RMA"))


def fabric_lines(fi):
    """Per chapter, the provider, fabric and domain its hints pick here."""
    return [fabric_line(fi, chapters, sum(getattr(fi.lib, c) for c in caps.split()))
            for chapters, caps in CHAPTER_CAPS]


def fabric_line(fi, chapters, caps):
    asked = f"{chapters} ({fi.tostr(caps, fi.lib.FI_TYPE_CAPS)})"
    try:
        info, why = fi.pick(None, caps)
    except (ValueError, fi.FabricError) as e:
        return (FIX, "fabric", f"{asked}: {e}")
    fabric = fi.string(info.fabric_attr.name)
    text = (f"{asked}: {fi.provider_of(info)} ({why}), fabric {fabric}, domain "
            f"{fi.string(info.domain_attr.name)}")
    for provider, wanted in fi.FABRICS.items():  # efa 2.x: efa-direct first, then efa
        listed = fabrics_listed(fi, provider, caps)
        if any(name != wanted for name in listed):
            text += (f"; {provider} lists {', '.join(listed)} for these hints, the chapters "
                     f"take {wanted}, and {fi.DIRECT} with -p {fi.DIRECT} (common/fabric FABRICS)")
    return (OK, "fabric", text)


def fabrics_listed(fi, provider, caps):
    """The fabrics `provider` offers for `caps`, in its order (efa's: prov/efa/src/efa_prov.c),
    to hints with efa-direct's mode too (DIRECT_MODE), or it would not be listed."""
    try:
        head = fi.getinfo(fi.hints(provider, caps=caps, fabric=False,
                                   mode=fi.MODE | fi.DIRECT_MODE))
    except fi.FabricError:
        return []
    return list(dict.fromkeys(fi.string(i.fabric_attr.name) for i in fi.each(head)))


# --- GPUs --------------------------------------------------------------------

def gpu_line(machine):
    """(line, PCI addresses of the GPUs CUDA sees)."""
    buses, why = topo.gpus_here()
    on_bus = topo.physical_gpus(machine.sysfs)
    if buses:
        return (OK, "GPU", f"{len(buses)} CUDA devices ({' '.join(buses)})"), buses
    if on_bus:
        return (FIX, "GPU", f"{len(on_bus)} NVIDIA GPUs on the PCI bus, but {why}: install the "
                "NVIDIA driver and cupy (pip install cupy-cuda13x, or -cuda12x for CUDA 12)"), []
    return (ABSENT, "GPU", f"none on this machine (no NVIDIA GPU on the PCI bus; {why}): "
            "the chapters use host memory"), []


def gpu_memory_lines(fi, providers):
    """A real registration of GPU 0 memory with each of `providers` (one line each)."""
    from common.fabric import memory
    lines, context = [], None
    for provider in providers:
        granted = offered(fi, provider, fi.lib.FI_MSG | fi.lib.FI_RMA | fi.lib.FI_HMEM)
        if granted is None:
            why = ("is FI_EFA_USE_DEVICE_RDMA=0, or is GPUDirect (peer to peer) off?"
                   if provider == "efa" else "is this libfabric built without CUDA?")
            lines.append((FIX, "GPU memory", f"{provider} does not grant FI_HMEM, so GPU "
                          f"buffers cannot be registered with it: {why}"))
            continue
        try:
            with fi.Closer() as own:
                # the endpoint first, as the chapters open it: on efa it requires GPUDirect
                # (fi.require_gpudirect), which a registration alone never shows (efa's
                # rdm/efa_rdm_mr.c efa_rdm_mr_reg_impl answers with a made-up key, and the
                # transfers go through host memory)
                domain, _, _, _ = fi.open_endpoint(own, granted)
                buf = memory.Buffer(1 << 16, gpu=0)
                context = context or dmabuf_context_line(fi)  # as it is at registration
                mr, how = memory.register_device(domain, buf.ptr, buf.size, memory.WRITE_TARGET,
                                                 1, buf.iface, buf.device)
                own(mr)
        except (ValueError, fi.FabricError) as e:
            said = str(e)  # fi.require_gpudirect's names the provider already
            lines.append((FIX, "GPU memory", said if said.startswith(f"{provider}:")
                          else f"{provider}: {said}"))
            continue
        lines.append((OK, "GPU memory", f"{provider} registers GPU 0 memory (FI_HMEM): "
                      + how.removeprefix("GPU memory registered ")))
    return lines + [context] * bool(context)


def dmabuf_here(fi):
    """Whether GPU memory is registered by dmabuf here: the binding was built with
    FI_MR_DMABUF (common/fabric/memory.py) and CUDA exports dmabufs."""
    return bool(fi.lib.tut_has_dmabuf()) and cuda_attribute(cuda_driver.DMA_BUF_SUPPORTED) == 1


def dmabuf_context_line(fi, current=None):
    """Is a CUDA context current on the thread about to register GPU memory by dmabuf?
    Without one, CUDA's dmabuf export fails (CUDA_ERROR_INVALID_CONTEXT): the
    application's own for FI_MR_DMABUF, and libfabric's too (src/hmem_cuda.c,
    cuda_get_dmabuf_fd, makes no context of its own). efa then registers by address,
    EFAULT without nvidia_peermem (libfabric issue 12019), or in 2.6.0 fails with
    "Operation not supported" (prov/efa/src/efa_mr.c, efa_mr_reg_ibv_mr; efa_hmem.c
    gives CUDA no dmabuf fallback); verbs falls back to ibv_reg_mr
    (prov/verbs/src/verbs_mr.c, vrb_reg_hmem_dmabuf). None where dmabuf is not in play.
    `current()`: cuda_driver.current_context, or a test's."""
    if not dmabuf_here(fi):
        return None
    try:
        current = (current or cuda_driver.current_context)()
    except ValueError as e:
        return (ABSENT, "dmabuf context", f"cannot ask the CUDA driver ({e})")
    if current:
        return (OK, "dmabuf context", "a CUDA context is current where GPU memory is "
                "registered (cuCtxGetCurrent), as the dmabuf export needs; so must it be on "
                "each thread of yours that registers")
    return (FIX, "dmabuf context", "no CUDA context is current on the thread about to "
            "register GPU memory: its dmabuf export fails (CUDA_ERROR_INVALID_CONTEXT), "
            "then efa's registration (EFAULT, or Operation not supported): make the GPU's "
            "primary context current on that thread first (cudaSetDevice(gpu), or "
            "cuDevicePrimaryCtxRetain and cuCtxSetCurrent)")


def cuda_attribute(which, gpu=0):
    """A CUDA driver device attribute (common/gpu/cuda_driver.py), or None where it cannot
    be read."""
    try:
        return cuda_driver.attribute(which, gpu)
    except ValueError:
        return None


def nic_to_gpu_line(fi, machine, real_nic):
    """How a NIC reaches GPU memory: dmabuf (needs CUDA's support and libfabric >= 1.20)
    or nvidia-peermem; and whether its writes need a flush before a kernel reads them."""
    dmabuf = cuda_attribute(cuda_driver.DMA_BUF_SUPPORTED) == 1
    peermem = (machine.sysfs / "module" / "nvidia_peermem").is_dir()
    api = fi.version() >= (1, 20)
    order = {cuda_driver.NONE: "must be flushed (none)",
             cuda_driver.OWNER: "ordered for the GPU (owner)",
             cuda_driver.ALL_DEVICES: "ordered for all GPUs"}.get(
        cuda_attribute(cuda_driver.WRITES_ORDERING), "unknown")
    text = (f"dmabuf: CUDA {'supports' if dmabuf else 'does not support'} it, libfabric "
            f"{'%d.%d' % fi.version()} {'has' if api else 'lacks'} FI_MR_DMABUF (>= 1.20); "
            f"nvidia_peermem {'loaded' if peermem else 'not loaded'}; NIC writes into GPU "
            f"memory: {order}")
    if (dmabuf and api) or peermem:
        return (OK, "NIC to GPU", text)
    if not real_nic:
        return (ABSENT, "NIC to GPU", f"{text} (no RDMA NIC here to need either)")
    return (FIX, "NIC to GPU", f"{text}: modprobe nvidia_peermem, or for dmabuf the NVIDIA "
            "open kernel driver and Linux >= 5.12" + ("" if api else ", and libfabric >= 1.20"))


def topology_line(machine, buses, nics):
    if not buses or not nics:
        missing = "GPU" if not buses else "NIC with a PCI address"
        return (ABSENT, "GPU-NIC map", f"no {missing}: chapters 09+ open several domains of "
                "one provider as virtual NICs")
    gpus = topo.machine_layout(buses, nics, machine.sysfs)  # all, if CUDA shows only some
    counts = sorted({len(g.nics) for g in gpus})
    share = (f"{counts[0]} NIC{'s' * (counts[0] != 1)} per GPU" if len(counts) == 1
             else f"{counts[0]}-{counts[-1]} NICs per GPU (uneven)")
    far = [f"{n.name} (NUMA {n.numa}) of {g.name()} (NUMA {g.numa})" for g in gpus
           for n in g.nics if None not in (n.numa, g.numa) and n.numa != g.numa]
    seen = f" ({len(buses)} seen by this process)" if len(buses) < len(gpus) else ""
    text = f"{len(gpus)} GPUs{seen}, {len(nics)} NICs: {share}"
    # Slurm, torchrun, CUDA_VISIBLE_DEVICES: the plan of the GPUs this process was given
    plan = "; " + ", ".join(f"{g.name()} ({g.bus}) drives {' '.join(n.name for n in g.nics)}"
                            for g in gpus if g.index is not None) + ", as with all seen" \
        if seen else ""
    if far:
        return (ABSENT, "GPU-NIC map", f"{text}; on another NUMA node: {', '.join(far[:2])}"
                f"{' ...' if len(far) > 2 else ''}{plan} (chapters/08_topo.py prints the table)")
    return (OK, "GPU-NIC map", f"{text}, each on its GPU's NUMA node{plan} "
            "(chapters/08_topo.py prints the table)")


# The EFA instances by their NICs: name, NICs, Gbps each (common/model/instances.py, which
# predicts what each should reach: notebooks/instances.ipynb, results/two_hosts/README.md).
EFA_INSTANCES = tuple((i.name, i.nics, i.link_gbps) for i in INSTANCES.values())


def instance_line(nics, provider="efa"):
    """Which EFA instance this is, told by its NICs' count and link speed (fi_info's
    link_attr); fewer NICs than an instance of their speed has is said, not a fix (a p4d has
    4 of 100 Gbps, and a p5 that lost some to the driver has fewer too). A
    ConnectX host (`provider` verbs) is only described: 8 x 400 Gbps is a p6-b200's shape."""
    if not nics:
        return (ABSENT, "instance", "no NIC with a PCI address: not an EFA or ConnectX host")
    speeds = sorted({n.gbps for n in nics})
    total = sum(n.gbps for n in nics)
    text = (f"{len(nics)} NICs of {speeds[0]:g} Gbps, {total:g} Gbps" if len(speeds) == 1
            else f"{len(nics)} NICs of {'/'.join(f'{g:g}' for g in speeds)} Gbps")
    if not total:
        return (ABSENT, "instance", f"{len(nics)} NICs that report no link speed: which "
                "instance this is cannot be told")
    if provider != "efa":
        return (OK, "instance", f"a ConnectX host ({provider}): {text}")
    for name, count, gbps in EFA_INSTANCES:
        if speeds == [gbps] and len(nics) == count:
            return (OK, "instance", f"{name}: {len(nics)} EFA NICs of {gbps} Gbps, {total:g} Gbps")
    short = [(count, name) for name, count, gbps in EFA_INSTANCES
             if speeds == [gbps] and len(nics) < count]
    if short:
        count, name = min(short)
        return (ABSENT, "instance", f"{len(nics)} EFA NICs of {speeds[0]:g} Gbps, {total:g} "
                f"Gbps: a {name} has {count}; if this is one, libfabric lists fewer: "
                "fi_info -p efa, and the EFA driver (ls /sys/class/infiniband)")
    known = ", ".join(name.split(".")[0] for name, _, _ in EFA_INSTANCES)
    return (ABSENT, "instance", f"not an EFA instance this project knows ({known}): {text}")


def version_lines(fi, version=None):
    """What the libfabric loaded (`version`: its major.minor, or a test's) changes on efa, a
    line each: FI_MORE on efa's own fabric, hardware counters, CQ wait objects."""
    version = version or fi.version()
    v = "%d.%d" % version
    rings = "%d.%d" % fi.EFA_RINGS_QUEUED
    if version >= fi.EFA_RINGS_QUEUED:
        more = (OK, "FI_MORE", f"libfabric {v}: efa's fabric rings the doorbell of a WRITE it "
                "queued (handshake, RNR): chapter 14 batches with FI_MORE on both fabrics")
    else:
        more = (ABSENT, "FI_MORE", f"efa's fabric on libfabric {v} may send a WRITE it queued "
                "with FI_MORE and ring no doorbell: chapter 14 leaves FI_MORE off on it "
                f"(one doorbell a WRITE); for batches, -p efa-direct, or libfabric >= {rings} "
                "(EFA installer >= 1.51.0)")
    cntr = "%d.%d" % fi.EFA_HW_COUNTERS
    counters = (OK if version >= fi.EFA_HW_COUNTERS else ABSENT, "HW counters",
                (f"libfabric {v}: efa counts completions in the device's counters by default"
                 if version >= fi.EFA_HW_COUNTERS else
                 f"libfabric {v}: efa's counters are software's (the device's by default from "
                 f"{cntr})") + "; either way a counter makes no progress: code that waits on "
                "fi_cntr_read must on -FI_EAGAIN read a CQ too, a CQ must still be read "
                "(FI_EFA_USE_HW_CNTR=0 turns the device's off; the chapters count nothing)")
    # the rule FABRIC_RULES applies (common/fabric/rules.h tut_rules_wait), at this version
    taken = [name for name, mode in (("efa", fi.lib.RULES_EFA),
                                     ("efa-direct", fi.lib.RULES_EFA_DIRECT))
             if not fi.lib.tut_rules_wait(mode, version[0] << 16 | version[1],
                                          fi.lib.FI_WAIT_UNSPEC, 0)]
    which = {2: "efa and efa-direct", 1: "efa-direct only", 0: "neither fabric"}[len(taken)]
    wait = (OK if len(taken) == 2 else ABSENT, "CQ wait",
            f"libfabric {v}: blocking CQ reads (FI_WAIT_UNSPEC, FI_WAIT_FD) on {which} "
            "(efa-direct from 2.3, efa from 2.5, FD only with FI_EFA_ENABLE_SHM_TRANSFER=0): "
            "the chapters poll, a server idling between clients backs off"
            + ("" if len(taken) == 2 else "; to block instead, libfabric >= 2.5"))
    return [more, counters, wait]


def direct_rma(fi, info):
    """Whether efa-direct offers WRITEs here: listed, with FI_RMA (the device does RDMA read,
    write and unsolicited-write receive: prov/efa/src/efa_prov_info.c)."""
    direct = direct_entries(fi, info)
    return bool(direct) and all(i.caps & fi.lib.FI_RMA for i in direct)


def chapter_line(fi, chapter, info, version=None):
    """efa or efa-direct for `chapter`, with why: what the chapter does against what each
    fabric is (prov/efa/docs/efa_fabric_comparison.md) on this device (`info`: efa's list,
    None where there is none) and libfabric (`version`)."""
    topic = f"chapter {chapter:02d}"
    if info is None:
        return (ABSENT, topic, "no EFA device here: the chapter runs on the default provider")
    version = version or fi.version()
    if chapter == 3:
        return (OK, topic, "either: it lists both fabrics (-p efa, -p efa-direct)")
    if chapter in (4, 5):
        return (OK, topic, "efa (-p efa): its messages go past one MTU, which efa's fabric "
                "cuts into packets; efa-direct sends one work request a message, up to the "
                "device's max_msg_size (efa_prov_info.c)")
    if not direct_rma(fi, info):
        return (OK, topic, "efa (-p efa): efa-direct has no FI_RMA here (the device lacks RDMA "
                "read, write or unsolicited-write receive, or libfabric < 2.0), and efa's "
                "fabric emulates WRITEs with messages")
    why = {14: ("one doorbell a batch with FI_MORE" + (
                "" if version >= fi.EFA_RINGS_QUEUED else
                "; FI_MORE off on efa's fabric on libfabric %d.%d" % version)),
           16: "each WRITE one work request; ranks on one host reach each other through "
               "the NIC (efa-direct has no shm path; -p efa takes shm for them)",
           17: "each WRITE one work request; ranks on one host reach each other through "
               "the NIC (efa-direct has no shm path; -p efa takes shm for them)",
           19: "one WRITE, one immediate (efa's fabric cuts a WRITE into 1 GiB segments, "
               "an immediate on each: the engine cuts it first)"}
    return (OK, topic, "efa-direct (-p efa-direct): "
            + why.get(chapter, "each WRITE one work request to the device, nothing between "
                               "(efa's fabric: packet entries and protocols on top)"))


# --- the host ----------------------------------------------------------------

def capabilities():
    """This process's effective capabilities, a bit mask."""
    m = re.search(r"^CapEff:\s+([0-9a-f]+)", read("/proc/self/status", ""), re.MULTILINE)
    return int(m[1], 16) if m else 0


def memlock_line(real_nic, limit=None, caps=None):
    """`limit` and `caps`: this process's unless given."""
    limit = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] if limit is None else limit
    if limit == resource.RLIM_INFINITY:
        return (OK, "locked memory", "ulimit -l: unlimited")
    if (capabilities() if caps is None else caps) & (1 << CAP_IPC_LOCK):
        return (OK, "locked memory", f"ulimit -l {limit >> 10} KiB, but this process has "
                "CAP_IPC_LOCK: no limit applies")
    text = f"ulimit -l is {limit >> 10} KiB: efa and verbs pin registered buffers (07: 2 x 1 GiB)"
    if not real_nic:
        return (ABSENT, "locked memory", f"{text}; shm and tcp pin nothing")
    return (FIX, "locked memory", f"{text}: ulimit -l unlimited (in a container: --ulimit "
            "memlock=-1, or memlock in /etc/security/limits.conf)")


def hugepage_line(machine):
    info = machine.meminfo()
    free, size = info.get("HugePages_Free", 0), info.get("Hugepagesize", 0)
    if free:
        return (OK, "huge pages", f"{free} free of {size} kB: efa's internal buffers use them")
    return (ABSENT, "huge pages", "none free: efa's internal buffers use normal pages (a small "
            "cost; for them: echo 1024 | sudo tee /proc/sys/vm/nr_hugepages)")


def gdrcopy_line(machine, buses):
    driver = (machine.dev / "gdrdrv").exists()
    library = ctypes.util.find_library("gdrapi")
    if driver and library:
        return (OK, "GDRCopy", f"/dev/gdrdrv and {library}: a libfabric built --with-gdrcopy "
                "copies small GPU messages through them")
    missing = ", no ".join(m for m, have in (("/dev/gdrdrv", driver), ("libgdrapi", library))
                           if not have)
    why = "no GPU here" if not buses else "install gdrcopy for faster small copies to GPU " \
        "memory (in a container also --device /dev/gdrdrv)"
    return (ABSENT, "GDRCopy", f"no {missing}: {why}; the MoE chapters' proxy needs none")


# --- all of it -----------------------------------------------------------------

def examine(machine, chapter=None):
    """Every line, in order; with `chapter`, which of efa's fabrics it should take."""
    line, fi = libfabric(machine)
    lines = [line]
    if fi:
        ours = loaded_from()
        loaded = load_like_a_serving_engine()
        binding = binding_line(fi, ours)
        lines += [binding,
                  libfabric_copies_line(ours, libfabrics(read("/proc/self/maps", "")), loaded)]
        if binding[0] == FIX:
            fi = None  # every fi_getinfo would fail: the lines that need one would mislead
    nics = {}  # provider -> its fi_info, for the real NICs usable here
    for provider in REAL_NICS if fi else ():
        line, info = nic_lines(fi, machine, provider)
        lines.append(line)
        if info is not None:
            nics[provider] = info
            if provider == "efa":
                lines.append(rdma_write_line(fi, info))
                lines += version_lines(fi)
    local = {p: info for p in ("shm", "tcp") if fi and (info := offered(fi, p))}
    if fi:
        lines.append((OK, "shm, tcp", f"usable: {', '.join(local)}") if local else
                     (FIX, "shm, tcp", "neither is usable: reinstall libfabric (bash "
                      "scripts/setup.sh)"))
        lines += fabric_lines(fi)
    real_nic = bool(nics) or any(machine.nics_on_bus(p) for p in REAL_NICS)
    line, buses = gpu_line(machine)
    lines.append(line)
    if buses and fi:
        lines += gpu_memory_lines(fi, [*nics, *("shm" for p in local if p == "shm")])
        lines.append(nic_to_gpu_line(fi, machine, real_nic))
    if fi:
        found = [n for info in nics.values() for n in topo.nics_here(info)]
        for provider, info in nics.items():
            lines.append(instance_line(topo.nics_here(info), provider))
        lines.append(topology_line(machine, buses, found))
        if chapter:
            lines.append(chapter_line(fi, chapter, nics.get("efa")))
    lines += [memlock_line(real_nic), hugepage_line(machine),
              gdrcopy_line(machine, buses)]
    return lines, summary(lines, real_nic, buses)


def summary(lines, real_nic, buses):
    fixes = sum(status == FIX for status, _, _ in lines)
    if fixes:
        return f"{fixes} line{'s' if fixes > 1 else ''} to fix (FIX)"
    if not real_nic and not buses:
        return "no RDMA NIC and no GPU here: every chapter runs on shm and tcp with host memory"
    return "nothing to fix"


def main():
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sysfs", default="/sys", help="root of sysfs (default /sys)")
    p.add_argument("--dev", default="/dev", help="device directory (default /dev)")
    p.add_argument("--chapter", type=int, help="a chapter's number: say whether it should "
                   "take efa or efa-direct here")
    args = p.parse_args()
    if args.chapter is not None and not 3 <= args.chapter <= 19:
        p.error(f"--chapter {args.chapter}: the chapters are 03-19")
    for name in ("sysfs", "dev"):
        if not Path(getattr(args, name)).is_dir():
            p.error(f"--{name} {getattr(args, name)}: no such directory")
    lines, verdict = examine(Machine(args.sysfs, dev=args.dev), args.chapter)
    for status, topic, text in lines:
        print(f"{status:<4} {topic:<14} {text}")
    print(verdict)
    return 1 if any(status == FIX for status, _, _ in lines) else 0


if __name__ == "__main__":
    usage.run(main)

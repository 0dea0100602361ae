"""NIXL as a peer: the same paged WRITEs as common/transfer, moved by NIXL's UCX backend.

    PYTHONPATH=. nixlenv/bin/python scripts/nixl_pages.py         # 1K..64K x 100, 10000
    PYTHONPATH=. nixlenv/bin/python scripts/nixl_pages.py --page-size 4K --pages 100 --json
    PYTHONPATH=.:<the NIXL folder> python3 scripts/nixl_pages.py --gpu 0 --json   # GPU 0 memory

(nixlenv: a venv of its own with nixl, below; PYTHONPATH=.: this repository's common/,
which that venv has not installed. scripts/transfer_bench.py --nixl PYTHON and the tests'
NIXL_PYTHON run it so.)

The question a reader of chapters 18-19 asks: what would NIXL (what Dynamo and
vLLM move KV caches with) do with the same pages? Two processes, both started
here (multiprocessing, spawn), each a nixl_agent with the UCX backend over a
host-memory (DRAM) region registered once (--gpu: GPU memory, below). The
target sends its agent metadata and the region's address to the initiator
through a pipe; the initiator add_remote_agent()s it and, for each (page
size, pages):
- fills its region with seeded pages: slot i holds the content of target page
  perm[i] (perm: a permutation seeded by --seed), as common/transfer's page
  lists say "page i of mine to page perm[i] of yours";
- prep_xfer_dlist()s one descriptor per page on each side and
  make_prepped_xfer("WRITE", range(pages), perm, notif) once (the time this
  takes is printed apart: `prep ms`), then transfer()s that handle --warmup +
  --repeats times, each with a notification of its own, and polls
  check_xfer_state() until DONE;
- the target polls get_new_notifs() until it has each repeat's notification,
  then counts, over every page, the bytes that differ from the seeded content
  (the region is zeroed before each case, so a page never written counts).
Gbps = 8 * pages * page size / time, Mpps = pages / time, as the series
counts: on the writer, from post to its own completion (DONE); median over
--repeats. `notif`: the median time from the post to the target holding the
notification (both clocks are CLOCK_MONOTONIC of this host).

Both sides poll without NIXL's progress thread (nixl_agent_config's default
is on; --progress-thread turns it on): on the 2-core VM, with it on, 100-page
transfers took 10-12 ms however small the pages (0.01 Mpps, notif ~12 ms),
against 0.3-1.8 ms without. Each poll is followed by a sched_yield() (POLITE
below), as spinning threads outnumber cores there.

Which UCX transports carried it: the initiator runs with UCX_PROTO_INFO=y,
and the protocol tables UCX prints (each side's stdout and stderr go to a file
the parent reads; what is not a table is passed on to stderr) are read back:
`ucx: put: ...; am: ...` under the table, and "ucx_protocols" in the record.
UCX_TLS, UCX_NET_DEVICES and the like pass through to both sides.

--gpu N: both regions in GPU N's memory, both processes on that GPU: one
allocation a side (cupy if the interpreter has it, else a CUDA build of
torch), registered once as VRAM with device id N, the transfer descriptors
VRAM on N too. The pages are seeded in a host copy the initiator uploads
before prep_xfer_dlist, and the target downloads its region after the last
notification and counts wrong bytes there; neither copy is timed. The header
and the record say "GPU N memory", the GPU and the allocator. UCX must see
the memory as CUDA's: the NIXL folder needs ucx/libuct_cuda and libucm_cuda
(else register_memory fails: "VRAM memory is detected as host by UCX"), and
UCX_TLS, where set, must name cuda_copy and cuda_ipc too (UCX_TLS=cma,tcp
leaves UCX nothing that reads GPU memory). cuda_ipc, zero-copy between two
processes of one GPU, declares peer-failure handling (UCX's
src/uct/cuda/cuda_ipc/cuda_ipc_iface.c), so the backend's error handling mode
does not rule it out as it does posix and sysv; the ucx: line says what UCX
chose. Device ids count the GPUs CUDA_VISIBLE_DEVICES leaves. On one H200
(both processes on it, through transfer_bench.py --gpu 0 --nixl python3): 0.91-77.6 Gbps
at 1-64 KiB, 0 wrong bytes, "ucx: put: cma/memory, cuda_ipc/cuda, tcp/lo"
(results/transfer/h200-shm-cuda.json).

--json writes results/runs/nixl_pages-<time>.json (or the path given): the
machine (its GPU with --gpu) and commit (common/records), "implementation":
"nixl (UCX)", the nixl and UCX versions, the UCX transports, "memory" ("host"
or "GPU N memory") and "allocator", the arguments, and one row per case
(ops, page_size, bytes, elapsed_s, gbps, mpps as common/bench.figures, and
notif_s, prep_s, wrong_bytes).

Needs nixl (nixl-cu13 or nixl-cu12 from PyPI; its _api needs numpy, its
nixl_ep torch) and no libfabric; the repo's .venv has no nixl, so it runs from
a venv of its own: `python3 -m venv nixlenv && nixlenv/bin/pip
install nixl-cu13`, run with this repository on its PYTHONPATH for common/
(on a CPU-only box torch CPU is enough: `pip install
--no-deps` its wheel, then filelock fsspec jinja2 networkx sympy
typing-extensions numpy "setuptools>=77.0.3").

Two things of this NIXL (1.5.1, wheel nixl-cu13) that the script works around:
- a process that created a UCX backend dies of SIGSEGV in exit(): the
  destructor of the libnl-route-3 bundled in the wheel (rtnl_tc_unregister,
  loaded with UCX's ib module) runs after what it needs is gone (gdb: _dl_fini
  -> rtnl_tc_unregister; UCX_MODULES=^ib avoids it). Both sides end with
  os._exit() once everything is released and sent.
- the UCX backend opens with ucx_error_handling_mode=peer, which leaves out
  UCX's shared-memory transports (posix, sysv): WRITEs go by cma
  (process_vm_writev, zero-copy, as libfabric shm's large RMA), the
  notifications by tcp over lo. `--backend-param ucx_error_handling_mode=none`
  moves the notifications to sysv.

On one H200 (python 3.12, torch there, 64 MiB carry): the cp312 wheel
(`pip download --no-deps --python-version 3.12 --platform
manylinux_2_28_x86_64 --only-binary=:all: nixl-cu13`) is 56 MiB zipped, 227
MiB unpacked. What the UCX backend loads is 42 MiB of it: nixl_cu13/ (.py,
_bindings, _utils), nixl_cu13-1.5.1.dist-info, .nixl_cu13.mesonpy.libs/lib*.so
and plugins/libplugin_UCX.so, and of nixl_cu13.libs/ the NEEDED closure of
those (libucp, libuct, libucs, libucm, and libnixl's grpc, protobuf, etcd-cpp,
absl, upb, re2) with ucx/libuct_cma, ucx/libuct_cuda, ucx/libucm_cuda. Left
out: nixl_ep_cu13/ (91 MiB), every other plugin and the telemetry/nvtx .so in
.nixl_cu13.mesonpy.libs/plugins, the copies in nixl_cu13.libs/nixl/, the aws,
azure, curl, xml2, aio, uring, gusli libs they need, ucx/libuct_ib*,
libucx_perftest_*, and .data/ (headers). Unpack it here, keep that list, carry
the folder, run with PYTHONPATH=.:<folder>; the same cut of the cp311 wheel ran
this script here. It needs from the host libcudart.so.13 (import torch first,
if torch is a CUDA 13 build; else nixl-cu12), libnvidia-ml.so.1, libssl.so.3.

Transcript (2-core AMD EPYC VM, no GPU, no NIC, at dbacdfd, load average 3.5
from other jobs; nixl-cu13 1.5.1, UCX 1.23.0). The machine's load moves these
figures by 2-4x from run to run (64K x 10000 gave 42.3 Gbps in a run a minute
before); libfabric shm's fi_rma_bw -o write here (results/baselines/
vm-2core-shm-host.json): 14.8 Gbps at 4K, 38.7 at 16K, 56.7 at 64K:

    $ nixlenv/bin/python scripts/nixl_pages.py --json FILE
    nixl 1.5.1 (nixl_cu13), UCX 1.23.0, UCX_TLS=(all), progress thread off, 3 repeats after 1 warmup, host memory
      page  pages      Gbps     Mpps      min-max Gbps  notif us  prep ms  wrong
        1K    100     1.237    0.151    0.147-3.076       5572.0     0.22      0
        1K  10000     1.703    0.208    1.662-1.719      48568.6     1.42      0
        4K    100    14.170    0.432   13.133-14.725       231.5     0.15      0
        4K  10000    11.096    0.339   10.766-11.119     29845.1     1.62      0
        8K    100    18.869    0.288   15.036-19.497       455.1     0.16      0
        8K  10000    16.648    0.254   16.484-16.986     40018.3     1.22      0
       16K    100    27.434    0.209   17.849-29.690       894.9     0.16      0
       16K  10000    25.991    0.198   19.089-26.149     54247.3     1.33      0
       64K    100    40.141    0.077   29.822-46.430      1293.5     0.15      0
       64K  10000    12.679    0.024    9.737-13.074    413470.0     9.53      0
    ucx: put: cma/memory; am: tcp/lo  (UCX_PROTO_INFO of the initiator)
    wrote FILE
"""
import argparse
import importlib
import importlib.util
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:  # the standard library only: no libfabric here
    from common import records, usage
except ModuleNotFoundError:  # nixl's own venv, without this repository on its PYTHONPATH
    sys.exit(f"nixl_pages.py: this repository's common/ is not importable by {sys.executable}: "
             f"PYTHONPATH={ROOT} {sys.executable} {ROOT / 'scripts' / 'nixl_pages.py'}")

MODULES = ("nixl", "nixl_cu13", "nixl_cu12")  # the meta package, or one of its wheels
INSTALL = "python3 -m venv nixlenv && nixlenv/bin/pip install nixl-cu13"
# POLITE: both sides poll (check_xfer_state, get_new_notifs) with a sched_yield() between
# polls: where spinning threads outnumber the cores (the 2-core VM: two processes and NIXL's
# progress threads), a spinning side takes the time slices the other one needs.
PEER_TIMEOUT = 120.0  # seconds without word from a side before the run gives up
ALIGN = 4096
TABLE = re.compile(r"^\[[\d.]+\] \[[^]]+\]\s+[|+]")  # a line of UCX_PROTO_INFO's tables


def parse_list(kind):
    def parse(text):
        return [kind(t) for t in str(text).split(",") if t.strip()] or [kind(text)]
    return parse


def parse_param(text):
    key, eq, value = str(text).partition("=")
    if not eq or not key:
        raise argparse.ArgumentTypeError(f"a backend parameter is KEY=VALUE, got '{text}'")
    return key, value


def find_nixl():
    """The name of the nixl module this interpreter can import, or None."""
    for name in MODULES:
        try:
            if importlib.util.find_spec(f"{name}._api") is not None:
                return name
        except (ImportError, ValueError):
            continue
    return None


def nixl_version(module):
    from importlib import metadata
    for dist in metadata.packages_distributions().get(module, []) + [module.replace("_", "-")]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def seeded_page(np, seed, page, size):
    """common/fabric/memory.seeded_page: the content of page `page` for `seed`."""
    return np.random.default_rng([seed, page]).integers(0, 256, size, dtype=np.uint8)


def aligned(np, size):
    raw = np.zeros(size + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + size]


def gpu_allocator(gpu):
    """The allocator for GPU `gpu` ('cupy 14.0.1': cupy if importable, else a CUDA build of
    torch) and the GPU's name; ValueError, one line, if neither is here or no such GPU."""
    try:
        import cupy as cp
    except ImportError:
        cp = None
    if cp is not None:
        try:
            count = cp.cuda.runtime.getDeviceCount()
        except cp.cuda.runtime.CUDARuntimeError:  # no driver, or no device it can use
            count = 0
        who = f"cupy {cp.__version__}"
        name = lambda: cp.cuda.runtime.getDeviceProperties(gpu)["name"]
    else:
        try:
            import torch
        except ImportError:
            raise ValueError(f"--gpu {gpu}: GPU memory needs cupy or a CUDA build of torch; "
                             f"{sys.executable} has neither") from None
        if not torch.version.cuda:
            raise ValueError(f"--gpu {gpu}: GPU memory needs cupy or a CUDA build of torch; "
                             f"{sys.executable} has no cupy and torch {torch.__version__}, "
                             f"a CPU build")
        count = torch.cuda.device_count()
        who = f"torch {torch.__version__}"
        name = lambda: torch.cuda.get_device_name(gpu)
    if not 0 <= gpu < count:
        raise ValueError(f"--gpu {gpu}: no such GPU here ({who} finds {count})")
    said = name()
    return who, said.decode() if isinstance(said, bytes) else said


class Region:
    """One side's region of `size` bytes: host memory (numpy, page-aligned), or GPU `gpu`'s
    (cupy or torch, as `allocator` says) with a host copy of it, `host`, where the pages are
    seeded and checked. zero(), upload() and download() act on its first n bytes and return
    once the GPU is done (NIXL's copies run on streams of their own)."""

    def __init__(self, np, size, gpu=None, allocator=None):
        self.host = aligned(np, size)
        self.kind, self.device, self.address = "DRAM", 0, self.host.ctypes.data
        if gpu is None:
            return
        self.kind, self.device = "VRAM", gpu
        if allocator.startswith("cupy"):
            import cupy as cp
            cp.cuda.Device(gpu).use()  # the current device of the copies below
            self.array = cp.zeros(size, dtype=cp.uint8)
            self.address = self.array.data.ptr
            self.sync = cp.cuda.Device(gpu).synchronize
            self.put = lambda n: self.array[:n].set(self.host[:n])
            self.get = lambda n: self.array[:n].get(out=self.host[:n])
        else:
            import torch
            torch.cuda.set_device(gpu)
            self.array = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{gpu}")
            self.address = self.array.data_ptr()
            self.sync = lambda: torch.cuda.synchronize(gpu)
            self.put = lambda n: self.array[:n].copy_(torch.from_numpy(self.host[:n]))
            self.get = lambda n: torch.from_numpy(self.host[:n]).copy_(self.array[:n])

    def zero(self, n):
        if self.kind == "DRAM":
            self.host[:n] = 0
        else:
            self.array[:n] = 0
            self.sync()

    def upload(self, n):
        if self.kind == "VRAM":
            self.put(n)
            self.sync()

    def download(self, n):
        if self.kind == "VRAM":
            self.get(n)
            self.sync()


def now():
    return time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for both processes


def ucx_version():
    """UCX's own version string, from the libucp this process loaded."""
    import ctypes
    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps
                        if re.search(r"/libucp[-.][^/]*\.so", line))
        lib = ctypes.CDLL(path)
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        return lib.ucp_get_version_string().decode()
    except (OSError, StopIteration, AttributeError):
        return None


def make_agent(module, name, args, kind):
    """A nixl_agent with the UCX backend, taking memory `kind` ("DRAM" or "VRAM"), or raise
    RuntimeError saying why not."""
    api = importlib.import_module(f"{module}._api")
    config = api.nixl_agent_config(enable_prog_thread=args.progress_thread, backends=[])
    agent = api.nixl_agent(name, config)
    if "UCX" not in agent.get_plugin_list():
        raise RuntimeError(f"no UCX plugin among {agent.get_plugin_list()}")
    agent.create_backend("UCX", dict(args.backend_param))
    if f"{kind}_SEG" not in agent.get_backend_mem_types("UCX"):
        raise RuntimeError(f"UCX takes no {kind} here: {agent.get_backend_mem_types('UCX')}")
    return agent


def start(conn, np, module, name, args, size):
    """This side's agent and its region, registered once; None once the parent has been
    told why not. The agent comes first, as in NIXL's examples: registering VRAM sets the
    region's CUDA context for UCX (NIXL's src/plugins/ucx/ucx_backend.cpp, registerMem),
    which takes it only on the GPU of the device id given."""
    kind = "DRAM" if args.gpu is None else "VRAM"
    try:
        agent = make_agent(module, name, args, kind)
    except Exception as e:  # the backend's own words, whatever raised them
        conn.send(("error", f"NIXL's UCX backend did not start: {e}"))
        return None
    try:
        region = Region(np, size, args.gpu, args.allocator)
        reg = agent.register_memory(descs(np, region.address, size, 1, region.device), kind)
    except Exception as e:
        conn.send(("error", f"the {name}'s {size} bytes of {memory(args)}: {e}"))
        return None
    return agent, region, reg


def memory(args):
    """'host memory' or 'GPU 0 memory', as the header says it."""
    return "host memory" if args.gpu is None else f"GPU {args.gpu} memory"


def descs(np, base, size, pages, device=0):
    """One (address, length, device) row per page, as NIXL takes an Nx3 array."""
    rows = np.zeros((pages, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(pages, dtype=np.uint64) * size
    rows[:, 1] = size
    rows[:, 2] = device
    return rows


def quiet(folder, name):
    """This side's stdout and stderr (where UCX and NIXL log) into a file the parent reads:
    on failure the line that says why joins the parent's one line; otherwise what is not
    UCX_PROTO_INFO's tables is passed on to the parent's stderr."""
    fd = os.open(os.path.join(folder, f"{name}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def leave(conn):
    """A side's last step, whatever happened: its pipe closed, its output flushed, then
    os._exit(), not exit(): the wheel's libnl-route-3 crashes in its destructor."""
    conn.close()
    sys.stdout.flush()
    os._exit(0)


def target(conn, module, args, region, folder):
    """Registers a zeroed region, hands out its metadata, then per case: zero, wait for each
    repeat's notification, count wrong bytes."""
    try:
        quiet(folder, "target")
        import numpy as np
        if (started := start(conn, np, module, "target", args, region)) is None:
            return
        agent, mine, reg = started
        buf = mine.host
        conn.send(("ready", agent.get_agent_metadata(), mine.address))
        while (msg := conn.recv())[0] == "case":
            _, case, size, pages, seed, runs = msg
            mine.zero(size * pages)
            conn.send(("armed",))
            seen, deadline = {}, time.monotonic() + PEER_TIMEOUT
            tags = {f"{case}:{r}".encode(): r for r in range(runs)}
            while len(seen) < runs:
                for notes in agent.get_new_notifs().values():
                    t = now()
                    for note in notes:
                        if note in tags:
                            seen[tags[note]] = t
                os.sched_yield()  # see POLITE
                if time.monotonic() > deadline:
                    conn.send(("error", f"the target got {len(seen)} of {runs} notifications "
                                        f"in {PEER_TIMEOUT:.0f} s"))
                    return
            mine.download(size * pages)
            wrong = sum(int(np.count_nonzero(buf[p * size:(p + 1) * size]
                                             != seeded_page(np, seed, p, size)))
                        for p in range(pages))
            conn.send(("checked", [seen[r] for r in range(runs)], wrong))
        agent.deregister_memory(reg)
        del agent
        conn.send(("closed",))
    finally:
        leave(conn)


def initiator(conn, module, args, region, folder):
    """WRITEs the pages of each case into the target's region, --warmup + --repeats times."""
    try:
        quiet(folder, "initiator")
        os.environ["UCX_PROTO_INFO"] = "y"  # UCX prints its protocol tables: the parent reads
        import numpy as np
        if (started := start(conn, np, module, "initiator", args, region)) is None:
            return
        agent, mine, reg = started
        buf = mine.host
        conn.send(("ready", ucx_version()))
        _, metadata, remote_base = conn.recv()
        peer = agent.add_remote_agent(metadata)
        conn.send(("connected", peer))
        while (msg := conn.recv())[0] == "case":
            _, case, size, pages, seed, runs = msg
            perm = np.random.default_rng(seed).permutation(pages).astype(np.int32)
            for i in range(pages):
                buf[i * size:(i + 1) * size] = seeded_page(np, seed, int(perm[i]), size)
            mine.upload(size * pages)
            t0 = time.perf_counter()
            # both regions on the same GPU: the remote rows carry our device id too
            local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(np, mine.address, size, pages,
                                                                   mine.device), mine.kind)
            remote = agent.prep_xfer_dlist(peer, descs(np, remote_base, size, pages, mine.device),
                                           mine.kind)
            handle = agent.make_prepped_xfer("WRITE", local, np.arange(pages, dtype=np.int32),
                                             remote, perm)
            prep = time.perf_counter() - t0
            posts, dones = [], []
            for r in range(runs):
                posts.append(now())
                state = agent.transfer(handle, f"{case}:{r}".encode())
                deadline = time.monotonic() + PEER_TIMEOUT
                while state == "PROC":
                    state = agent.check_xfer_state(handle)
                    os.sched_yield()  # see POLITE
                    if time.monotonic() > deadline:
                        state = f"still in progress after {PEER_TIMEOUT:.0f} s"
                dones.append(now())
                if state != "DONE":
                    conn.send(("error", f"transfer {r} of {pages} pages of {size} bytes: "
                                        f"{state} (check_xfer_state)"))
                    return
            backend = agent.query_xfer_backend(handle)
            handle.release()
            local.release()
            remote.release()
            conn.send(("done", posts, dones, prep, backend))
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
        del agent
        conn.send(("closed",))
    finally:
        leave(conn)


def ucx_protocols(text):
    """{operation: [how, transport]} from UCX_PROTO_INFO's tables, for the endpoints to the
    other process (intra-node or inter-node; not the agent's endpoint to itself)."""
    found, op, rows = {}, None, None
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1 and re.search(r" (intra|inter)-node cfg#\d+$", cells[0]):
            op, rows = "next", None
        elif len(cells) == 1 and op == "next":
            op = cells[0]
            rows = found.setdefault(op, [])
        elif len(cells) == 3 and rows is not None and cells[0] != "Range":
            entry = f"{cells[1]} {cells[2]}"
            if entry not in rows:
                rows.append(entry)
        elif len(cells) == 1:
            op, rows = None, None
    return found


def brief(protocols):
    """'put: zero-copy cma/memory; am: ... tcp/lo': the transports of put and am."""
    parts = []
    for kind, pattern in (("put", "remote memory write"), ("am", "active message")):
        hows = sorted({h for op, rows in protocols.items() if op.startswith(pattern)
                       for h in rows})
        if hows:
            parts.append(f"{kind}: {', '.join(sorted({h.split()[-1] for h in hows}))}")
    return "; ".join(parts) or "not reported"


def said(folder):
    """' (UCX: ...)': the first error line NIXL or UCX logged on either side, if any."""
    for path in sorted(Path(folder).glob("*.log"), key=lambda p: p.stem != "target"):
        for line in path.read_text(errors="replace").splitlines():
            if "UCX  ERROR" in line or re.match(r"E\d{4} ", line):
                words = re.sub(r"^(\[[^]]*\] )*\S+\.(c|cpp|h):\d+\]?\s*", "",
                               re.sub(r"^(\[[\d.]+\] \[[^]]+\]\s+|E\d{4} [\d:.]+\s+\d+ )",
                                      "", line)).strip()
                return f" ({path.stem}: {words})"
    return ""


class Side:
    """One child process and our end of its pipe; recv() waits a bounded time."""

    def __init__(self, ctx, name, fn, *fargs):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=fn, args=(child, *fargs), name=name, daemon=True)
        self.proc.start()
        child.close()

    def recv(self, what):
        deadline = time.monotonic() + PEER_TIMEOUT
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the {self.name} exited ({self.proc.exitcode}) before "
                                   f"{what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {self.name} said nothing for {PEER_TIMEOUT:.0f} s "
                                   f"(waiting for {what})")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the {self.name} went away before {what}") from None
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        return msg

    def stop(self, wait=5.0):
        """Give it `wait` s to end by itself (it has said its last), then SIGTERM, then
        SIGKILL: a Ctrl-C of ours waits for no word from it (0 s)."""
        self.proc.join(wait)
        for end in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                end()
                self.proc.join(1)


def run(args, module):
    cases = [(s, n) for s in args.page_size for n in args.pages]
    region = max(s * n for s, n in cases)
    runs = args.warmup + args.repeats
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="nixl_pages-") as tmp:
        sides = [Side(ctx, "target", target, module, args, region, tmp),
                 Side(ctx, "initiator", initiator, module, args, region, tmp)]
        tgt, ini = sides
        rows = []
        try:
            _, metadata, base = tgt.recv("its metadata")
            _, ucx = ini.recv("its backend started")
            ini.conn.send(("peer", metadata, base))
            ini.recv("add_remote_agent")
            print(f"nixl {nixl_version(module)} ({module}), UCX {ucx or '?'}, "
                  f"UCX_TLS={os.environ.get('UCX_TLS', '(all)')}, "
                  f"progress thread {'on' if args.progress_thread else 'off'}, "
                  f"{args.repeats} repeats after {args.warmup} warmup, {memory(args)}"
                  f"{'' if args.gpu is None else f' ({args.gpu_name}, {args.allocator})'}",
                  flush=True)
            print(f"{'page':>6} {'pages':>6} {'Gbps':>9} {'Mpps':>8} {'min-max Gbps':>17} "
                  f"{'notif us':>9} {'prep ms':>8} {'wrong':>6}", flush=True)
            for case, (size, pages) in enumerate(cases):
                seed = args.seed + case
                tgt.conn.send(("case", case, size, pages, seed, runs))
                tgt.recv("zeroing its region")
                ini.conn.send(("case", case, size, pages, seed, runs))
                _, posts, dones, prep, backend = ini.recv(f"{runs} transfers of {pages} pages")
                _, notified, wrong = tgt.recv("the notifications and the check")
                keep = slice(args.warmup, None)
                times = [d - p for p, d in zip(posts[keep], dones[keep])]
                notif = [n - p for p, n in zip(posts[keep], notified[keep])]
                gbps = [8 * size * pages / t / 1e9 for t in times]
                row = {"ops": pages, "page_size": size, "pages": pages, "bytes": size * pages,
                       "repeats": args.repeats, "warmup": args.warmup,
                       "elapsed_s": statistics.median(times), "elapsed_all_s": times,
                       "gbps": statistics.median(gbps), "mpps": pages / statistics.median(times)
                       / 1e6, "notif_s": statistics.median(notif), "prep_s": prep,
                       "wrong_bytes": wrong, "backend": backend}
                rows.append(row)
                print(f"{size // 1024 if size % 1024 == 0 else size:>5}{'K' * (size % 1024 == 0)}"
                      f" {pages:>6} {row['gbps']:>9.3f} {row['mpps']:>8.3f} "
                      f"{min(gbps):>8.3f}-{max(gbps):<8.3f} {1e6 * row['notif_s']:>9.1f} "
                      f"{1e3 * prep:>8.2f} {wrong:>6}", flush=True)
            for side in sides:
                side.conn.send(("end",))
                side.recv("closing")
        except RuntimeError as e:
            for side in sides:
                side.stop()
            raise RuntimeError(f"{e}{said(tmp)}") from None
        except BaseException:  # Ctrl-C or SIGTERM: within its 2 s (common/bounds.py)
            for side in sides:
                side.stop(0)
            raise
        finally:
            for side in sides:
                side.stop()
            logs = {p.stem: p.read_text(errors="replace") for p in Path(tmp).glob("*.log")}
        for name, text in sorted(logs.items()):
            sys.stderr.write("".join(f"{name}: {line}\n" for line in text.splitlines()
                                     if not TABLE.match(line)))
        protocols = ucx_protocols(logs.get("initiator", ""))
        print(f"ucx: {brief(protocols)}  (UCX_PROTO_INFO of the initiator)", flush=True)
        data = {"implementation": "nixl (UCX)", "nixl": nixl_version(module), "module": module,
                "ucx": ucx, "ucx_tls": os.environ.get("UCX_TLS"), "ucx_protocols": protocols,
                "ucx_transports": brief(protocols),
                "memory": "host" if args.gpu is None else memory(args),
                "allocator": args.allocator,
                "progress_thread": args.progress_thread,
                "backend_params": dict(args.backend_param), "args": records.arguments(),
                "machine": {**records.machine(), "gpu": args.gpu_name},
                "git": records.git_sha(),
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "runs": rows}
        return data, sum(r["wrong_bytes"] for r in rows)


def main(argv=None):
    p = usage.Parser(description=__doc__.split("\n")[0])
    p.add_argument("--page-size", type=parse_list(usage.positive(usage.parse_size, "a size")),
                   default="1K,4K,8K,16K,64K",
                   help="bytes per page, a comma list (K/M/G) (default 1K,4K,8K,16K,64K)")
    p.add_argument("--pages", type=parse_list(usage.positive(int, "a count of pages")),
                   default="100,10000",
                   help="pages per transfer, a comma list (default 100,10000)")
    p.add_argument("--repeats", type=int, default=3, help="timed transfers per case (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed transfers before them")
    p.add_argument("--seed", type=int, default=1, help="of the permutation and the data")
    p.add_argument("--progress-thread", action="store_true",
                   help="NIXL's progress thread on (nixl_agent_config's default; off here: "
                   "only polling makes progress, as in the engine)")
    p.add_argument("--backend-param", type=parse_param, action="append", default=[],
                   metavar="KEY=VALUE", help="a UCX backend init parameter (repeatable), e.g. "
                   "ucx_error_handling_mode=none")
    p.add_argument("--gpu", type=int, metavar="N", help="both sides' regions in GPU N's "
                   "memory (cupy, else torch), registered as VRAM")
    p.add_argument("--json", nargs="?", const="auto", metavar="PATH",
                   help="write the record (bare: results/runs/nixl_pages-<time>.json)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats takes 1 or more, --warmup 0 or more")
    module = find_nixl()
    if module is None:
        print(f"nixl_pages.py: nixl is not importable by {sys.executable} (python "
              f"{sys.version.split()[0]}): {INSTALL} (nixl-cu12 for CUDA 12), then run this "
              f"with PYTHONPATH=. nixlenv/bin/python", file=sys.stderr)
        return 1
    try:
        args.allocator, args.gpu_name = (None, None) if args.gpu is None else \
            gpu_allocator(args.gpu)
    except ValueError as e:
        print(f"nixl_pages.py: {e}", file=sys.stderr)
        return 1
    try:
        data, wrong = run(args, module)
    except RuntimeError as e:
        print(f"nixl_pages.py: {e}", file=sys.stderr)
        return 1
    if args.json:
        path = args.json if args.json != "auto" else ROOT / "results" / "runs" / \
            time.strftime("nixl_pages-%Y%m%dT%H%M%S.json")
        print(f"wrote {records.write_json(path, data)}")
    if wrong:
        print(f"nixl_pages.py: {wrong} wrong bytes on the target", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    usage.run(main)

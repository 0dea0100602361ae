"""What the benchmark scripts measure: the tools a user would reach for (fabtests'
fi_rma_bw, UCX's ucx_perftest, cudaMemcpyPeer) and a chapter run the same way, per size.

scripts/baseline.py, bench.py, progression.py and two_hosts.py share these; the
command lines, and what each writes, are in their docstrings.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import common.fabric as fi
from common import bench, cli, usage
from common.chapter_pair import INTERRUPTED_WAIT, stop_all, run_pair as run_chapter_pair
from common.launch import owned


def prefix():
    return bench.tools_prefix()


def tool_env(extra_libs=()):
    libs = [str(prefix() / "lib"), "/usr/local/cuda/lib64", *extra_libs]
    return dict(os.environ, LD_LIBRARY_PATH=":".join(libs + [os.environ.get("LD_LIBRARY_PATH", "")]))


def run_pair(server, client, env, timeout):
    """Start `server`, then `client` (retrying while the server is not listening yet);
    returns both outputs. Both are ours (common.launch.owned): after a failure, a timeout
    or our Ctrl-C, one still running is stopped, Ctrl-C first, and what a killed one left
    in /dev/shm is removed (fabtests' shm regions, named after its pid)."""
    srv = owned(server, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tool = None
    try:
        for _ in range(50):
            time.sleep(0.2)
            tool = owned(client, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
            said, complaint = tool.communicate(timeout=timeout)
            if tool.returncode == 0 or srv.poll() is not None:
                break
        out, _ = srv.communicate(timeout=timeout)
    finally:
        stop_all([p for p in (tool, srv) if p is not None], INTERRUPTED_WAIT)
    if tool.returncode or srv.returncode:
        raise RuntimeError(f"{' '.join(client)} failed: "
                           f"{(said + complaint).strip().splitlines()[-1:]} / "
                           f"server: {out.strip().splitlines()[-1:]}")
    return said, out


def tools_libfabric():
    """The version of the libfabric the tools there use (their fi_info --version), or None."""
    try:
        out = subprocess.run([str(prefix() / "bin" / "fi_info"), "--version"],
                             capture_output=True, text=True, env=tool_env()).stdout
    except OSError:
        return None
    return (re.findall(r"libfabric: ([\d.]+)", out) or [None])[0]


def rma_bw_tool():
    """fabtests' fi_rma_bw, from bench.tools_prefix()/bin."""
    tool = prefix() / "bin" / "fi_rma_bw"
    if not tool.exists():
        raise FileNotFoundError(f"{tool} not found (fabtests are not in Debian's packages): "
                                "build libfabric and fabtests with `bash scripts/build_libfabric.sh`,"
                                " or set FABTESTS_PREFIX to an install that has bin/fi_rma_bw")
    return tool


def rma_bw_command(provider, op, size, iters, gpu=None, port=None, nic=None, window=None):
    """One side's fi_rma_bw (a client adds the server's host): -E exchanges the addresses
    over a TCP socket (on `port`, default 3000), which shm needs; `nic`: (fabric, domain);
    `window`: its -W, the messages in flight and in its buffers (default 64)."""
    command = [str(rma_bw_tool()), "-p", provider, f"-E={port}" if port else "-E", "-o", op,
               "-S", str(size), "-I", str(iters)]
    if window:
        command += ["-W", str(window)]
    if nic:
        command += ["-f", nic[0], "-d", nic[1]]
    if gpu is not None:
        command += ["-D", "cuda", "-i", str(gpu)]
    return command


def rma_bw_gbps(output):
    """The Gbps of fi_rma_bw's figures line (fabtests prints MB/s of 10^6 bytes)."""
    row = next((line.split() for line in output.splitlines()
                if re.match(r"^\d+[kmg]?\s+\d", line)), None)
    if row is None:
        raise RuntimeError(f"fi_rma_bw printed no figures: {output.strip()[-300:]}")
    return float(row[4]) * 8 / 1000


def fi_rma_bw(provider, op, size, iters, gpus, timeout, window=None):
    """One run of fi_rma_bw between two processes here; the client's Gbps."""
    server = rma_bw_command(provider, op, size, iters, gpus and gpus[0], window=window)
    client = rma_bw_command(provider, op, size, iters, gpus and gpus[1],
                            window=window) + ["127.0.0.1"]
    out, _ = run_pair(server, client, tool_env(), timeout)
    return rma_bw_gbps(out), " ".join(client[1:])


def ucx_put_bw(ucx, size, iters, gpus, timeout):
    """One run of ucx_perftest put bandwidth between the two GPUs (cuda_ipc); Gbps."""
    ucx = Path(ucx)
    tool = ucx / "libucx" / "bin" / "ucx_perftest"
    env = tool_env([str(ucx / "libucx" / "lib"), str(ucx / "libucx_cu13.libs")])
    env["UCX_MODULE_DIR"] = str(ucx / "libucx" / "lib" / "ucx")
    base = [str(tool), "-t", "ucp_put_bw", "-m", "cuda", "-s", str(size), "-n", str(iters)]
    # ucx_perftest puts rank r on GPU r % count: server GPU 0, client GPU 1
    out, _ = run_pair(base, base + ["localhost"], env, timeout)
    # the final summary line: "Final: iters typ avg overall(usec) ... bandwidth(MB/s) avg overall ..."
    final = next(line for line in out.splitlines() if line.strip().startswith("Final:"))
    numbers = [float(x) for x in re.findall(r"[\d.]+", final)]
    return numbers[-3] * 1.048576 * 8 / 1000, " ".join(base[1:])


def memcpy_peer(size, iters, pairs):
    """cudaMemcpyPeer for each (source GPU, destination GPU) pair, all at once: the ceiling
    of any transport between them. The copies are captured in a CUDA graph and the graph
    launched, so that the CPU's cost of enqueuing a copy (microseconds, the time of a
    1 MiB copy over NVLink) does not set the pace. Gbps summed over the pairs."""
    import cupy as cp
    per_graph = min(iters, 64)
    runs = []  # (GPU, stream, graph, start, end, buffers)
    for src_gpu, dst_gpu in pairs:
        with cp.cuda.Device(src_gpu):
            src = cp.zeros(size, dtype=cp.uint8)
        with cp.cuda.Device(dst_gpu):
            dst = cp.zeros(size, dtype=cp.uint8)
            try:  # over NVLink directly, not staged through host memory
                cp.cuda.runtime.deviceEnablePeerAccess(src_gpu)
            except cp.cuda.runtime.CUDARuntimeError:
                pass  # already enabled, or no peer access between these two
            stream = cp.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                for _ in range(per_graph):
                    # what cudaMemcpyPeerAsync does, in a form graphs can hold
                    cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, size,
                                                cp.cuda.runtime.memcpyDefault, stream.ptr)
                graph = stream.end_capture()
            graph.launch(stream)  # once untimed: uploads the graph
            runs.append((dst_gpu, stream, graph, cp.cuda.Event(), cp.cuda.Event(), (src, dst)))
    rounds = -(-iters // per_graph)
    for gpu, stream, _, start, _, _ in runs:
        with cp.cuda.Device(gpu):
            start.record(stream)
    for _ in range(rounds):  # the pairs in turn, so that they run side by side
        for gpu, stream, graph, _, _, _ in runs:
            with cp.cuda.Device(gpu):
                graph.launch(stream)
    gbps = 0.0
    for gpu, stream, _, start, end, _ in runs:
        with cp.cuda.Device(gpu):
            end.record(stream)
        end.synchronize()
        gbps += 8 * size * rounds * per_graph / (cp.cuda.get_elapsed_time(start, end) / 1e3) / 1e9
    return gbps, "cudaMemcpyPeer " + ", ".join(f"GPU{a} -> GPU{b}" for a, b in pairs)


# Holds a stream until the host lets it go: what is queued behind it then runs back to
# back, so that CUDA events around a kernel time the GPU, not the host's launch.
HOLD = 'extern "C" __global__ void hold(volatile unsigned *gate) { while (!*gate) {} }'


def gather_ceiling(gpu, page, src_pages, dst_pages, size, repeats):
    """What one GPU does with the same pages in one process, the ceiling of the transfer
    engine's CUDA IPC route (common/transfer/ipc.py) on that GPU: medians over `repeats`
    of (1) the route's own kernel gathering page src_pages[i] of one buffer of `size`
    bytes to page dst_pages[i] of another, its GPU time alone (CUDA events around it,
    queued behind a held stream: no launch and no table upload in the time), (2) the same
    from the Python call to seeing its mark in host memory, as the route sends a command
    (ipc.Copier.send: the table built, uploaded, the kernel launched), (3) one
    contiguous device copy of as many bytes (events, held the same way) and (4) CUDA's
    batched copy of the same pages (cuMemcpyBatchAsync), from the call, its address lists
    built, to the stream's end (None where the driver has none)."""
    import cupy as cp
    import numpy as np
    from common.gpu.kernel_call import KernelCall
    from common.transfer import ipc
    copier = ipc.Copier(gpu)
    hold = cp.RawKernel(HOLD, "hold")
    src, dst = cp.ones(size, cp.uint8), cp.zeros(size, cp.uint8)
    whole_src, whole_dst = (cp.zeros(len(src_pages) * page, cp.uint8) for _ in range(2))
    marks = cp.cuda.alloc_pinned_memory(24)
    seen, finished = np.frombuffer(marks, np.uint64, 2)[:1], np.frombuffer(marks, np.uint64, 2)[1:]
    gate = np.frombuffer(marks, np.uint32, 1, 16)
    src_pages, dst_pages = (np.ascontiguousarray(x, np.int64) for x in (src_pages, dst_pages))
    table = cp.asarray(np.concatenate([src_pages, dst_pages]).astype(np.uint64))
    count, stream = len(src_pages), copier.stream
    per_copy = -(-page // ipc.CHUNK)
    kernel = KernelCall(copier.kernel, stream, ipc.THREADS, src=src, dst=dst, table=table,
                        scale=page, count=count, length=page, lengths=0, chunk=ipc.CHUNK,
                        per_copy=per_copy, seq_at=0, seq=0, finished=finished.ctypes.data,
                        number=0, blocks_done=copier.blocks_done)
    blocks = min(count * per_copy, copier.c.max_blocks)

    def spin(ready, why):
        while not ready():
            pass

    def held(enqueue):
        """GPU seconds of what `enqueue()` queues, behind the held stream."""
        start, end = cp.cuda.Event(), cp.cuda.Event()
        gate[0] = 0
        with stream:
            hold((1,), (1,), (gate.ctypes.data,))
        start.record(stream)
        enqueue()
        end.record(stream)
        gate[0] = 1
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) / 1e3

    def copy():
        cp.cuda.runtime.memcpyAsync(whole_dst.data.ptr, whole_src.data.ptr, count * page,
                                    cp.cuda.runtime.memcpyDeviceToDevice, stream.ptr)

    kernel_s, whole, contiguous, batched = [], [], [], []
    for repeat in range(repeats + 1):  # the first: untimed (modules load, pools fill)
        took = held(lambda: kernel(blocks))
        stream.synchronize()
        called = time.perf_counter()
        copier.send(src.data.ptr, src_pages, dst.data.ptr, dst_pages, page, spin, size,
                    page_size=page, seq_at=seen.ctypes.data, seq=repeat + 1)
        while seen[0] != repeat + 1:
            pass
        if repeat:
            kernel_s.append(took)
            whole.append(time.perf_counter() - called)
            contiguous.append(held(copy))
        stream.synchronize()
    # The batched copy last (it slowed the calls above when it came first), not behind a
    # held stream: a long batch blocks its caller until the GPU has taken most of it.
    batch = batch_copy(src, src_pages, dst, dst_pages, page, stream)
    for repeat in range(repeats + 1 if batch else 0):
        called = time.perf_counter()
        batch()
        stream.synchronize()
        if repeat:
            batched.append(time.perf_counter() - called)
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"gather_kernel_s": median(kernel_s), "gather_call_s": median(whole),
            "device_copy_s": median(contiguous), "batch_call_s": median(batched)}


def batch_copy(src, src_pages, dst, dst_pages, page, stream):
    """CUDA's batched copy of page src_pages[i] of `src` to page dst_pages[i] of `dst`
    (cupy arrays) on `stream`: a function that builds the address lists and queues the
    batch; None where the driver has no cuMemcpyBatchAsync (CUDA 12.8's) or refuses it
    (said in one line)."""
    import numpy as np
    from common.gpu import cuda_driver
    ffi = cuda_driver.ffi
    try:
        call = cuda_driver.function("cuMemcpyBatchAsync_v2")
    except ValueError:
        return None
    attrs = ffi.new("struct cu_memcpy_attributes *", dict(
        src_access_order=cuda_driver.IN_STREAM_ORDER, src_type=cuda_driver.ON_DEVICE,
        src_id=src.device.id, dst_type=cuda_driver.ON_DEVICE, dst_id=dst.device.id))
    first = ffi.new("size_t *", 0)
    count, on = len(src_pages), ffi.cast("void *", stream.ptr)
    sizes = ffi.from_buffer("size_t[]", np.full(count, page, np.uint64))
    failed = []

    def queue():
        lists = [np.asarray(pages, np.uint64) * np.uint64(page) + np.uint64(base.data.ptr)
                 for pages, base in ((dst_pages, dst), (src_pages, src))]
        at = [ffi.from_buffer("unsigned long long[]", x) for x in lists]
        rc = call(*at, sizes, count, attrs, first, 1, on)
        if rc:
            failed.append(cuda_driver.error_name(rc))

    queue()
    stream.synchronize()
    if failed:
        print(f"cuMemcpyBatchAsync refused: {failed[0]}", flush=True)
        return None
    return queue


def iterations(size, total_bytes, at_least=200):
    return max(at_least, total_bytes // size)


def needs(args, chapters=False, fabtests=True):
    """What the run needs, before anything runs: each missing piece is one line saying what
    provides it (a ValueError). Also a note when fi_rma_bw is another libfabric than the
    chapters': then its figures are no baseline for them."""
    fi.pick(args.provider, fi.lib.FI_MSG | fi.lib.FI_RMA)  # one line if unusable here
    if fabtests:
        try:
            rma_bw_tool()
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    if args.gpus:
        try:
            import cupy
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no cupy, no driver, no device: all say the same here
            raise ValueError(f"--gpus needs cupy and GPUs ({str(e).splitlines()[0]}): "
                             ".venv/bin/python -m pip install -e '.[gpu]'") from None
        if max(args.gpus) >= count:
            raise ValueError(f"--gpus {','.join(map(str, args.gpus))}: this machine has "
                             f"{count} GPUs")
    ucx = getattr(args, "ucx", None)
    if ucx and not (Path(ucx) / "libucx" / "bin" / "ucx_perftest").exists():
        raise ValueError(f"--ucx {ucx}: no libucx/bin/ucx_perftest there (unpack the "
                         "libucx-cu13 wheel into it)")
    theirs, ours = tools_libfabric(), "%d.%d" % fi.version()
    if fabtests and not bench.same_libfabric(theirs):
        print(f"note: fi_rma_bw is libfabric {theirs or '(unknown: no fi_info beside it)'}, "
              f"the chapters run {ours}: "
              + ("the ratios compare two libfabrics" if chapters else
                 "the chapters will not count its figures as their baseline"), flush=True)


def measure(tools, sizes, repeats, total_bytes, rows=None):
    """[{tool, size, iters, gbps[], median_gbps, command}] for each tool and size, runs
    interleaved. `rows`: a list filled as the figures come in, which the caller keeps when
    a run fails: a row cut short says so in its gbps list (its median is of those), a row
    not yet run has an empty one."""
    rows = [] if rows is None else rows
    for size in sizes:
        iters = iterations(size, total_bytes)
        batch = [{"tool": name, "size": size, "iters": iters, "gbps": []} for name, _ in tools]
        rows.extend(batch)
        try:
            for _ in range(repeats):  # tool after tool, so a noisy moment hits all of them
                for row, (_, fn) in zip(batch, tools):
                    gbps, row["command"] = fn(size, iters)
                    row["gbps"].append(round(gbps, 3))
        finally:
            for row in (r for r in batch if r["gbps"]):
                row["median_gbps"] = statistics.median(row["gbps"])
                print(f"  {row['tool']:<28} {size:>10} B  median {row['median_gbps']:9.3f} "
                      f"Gbps  ({', '.join(f'{g:.1f}' for g in row['gbps'])})", flush=True)
    return rows


def run_all(name, args, tools, keep, chapters=False):
    """Check what the run needs, measure, and `keep(rows)` what was measured, also when a
    run failed (then one line says what failed, and the exit is non-zero)."""
    try:
        needs(args, chapters, fabtests=any(n.startswith("fi_rma_bw") for n, _ in tools))
    except (ValueError, fi.FabricError) as e:
        sys.exit(f"{name}: {e}")
    rows = []
    try:
        measure(tools, args.sizes, args.repeats, args.bytes, rows)
    except (FileNotFoundError, RuntimeError, subprocess.TimeoutExpired) as e:
        rows = [r for r in rows if r["gbps"]]  # those that never ran have nothing to keep
        if rows:
            keep(rows)
        sys.exit(f"{name}: {e}" + ("; what was measured before it is written" if rows else ""))
    keep(rows)


def baseline_tools(provider, gpus, ucx, timeout):
    tools = [(f"fi_rma_bw -o {op}", lambda size, iters, op=op:
              fi_rma_bw(provider, op, size, iters, gpus, timeout)) for op in ("write", "writedata")]
    if gpus:
        if ucx:
            tools.append(("ucx_perftest ucp_put_bw", lambda size, iters:
                          ucx_put_bw(ucx, size, iters, gpus, timeout)))
        tools.append(("cudaMemcpyPeer", lambda size, iters: memcpy_peer(size, iters, [gpus])))
    return tools


def save(rows, kind, args):
    """Write (or add to) RESULTS/<kind>/<label>-<provider>-<memory>.json: rows of the same
    tool and size are replaced, others kept, each row saying when and at which commit. The
    libfabric is the tools' for baselines, the chapters' (this binding's) for chapters."""
    memory, gpus = "cuda" if args.gpus else "host", args.gpus
    stamp = {"git": bench.git_sha(), "date": datetime.now(timezone.utc).isoformat(
        timespec="seconds")}
    folder = Path(args.results) / ("baselines" if kind == "baseline" else kind)
    path = folder / f"{args.label}-{args.provider}-{memory}.json"
    new = {(r["tool"], r["size"]) for r in rows}
    try:
        kept = [r for r in json.loads(path.read_text())["runs"] if (r["tool"], r["size"]) not in new]
    except (OSError, ValueError, KeyError):
        kept = []
    runs = sorted(kept + [{**r, **stamp} for r in rows], key=lambda r: (r["size"], r["tool"]))
    data = {"kind": kind, "provider": args.provider, "memory": memory, "gpus": gpus,
            "libfabric": tools_libfabric() if kind == "baseline" else "%d.%d" % fi.version(),
            "machine": bench.machine(gpus[1] if gpus else None), **stamp, "runs": runs}
    bench.write_json(path, data)
    print(f"wrote {cli.shown(path)}")
    return path


def parser(doc):
    p = usage.Parser(description=doc.split("\n\n")[0])
    p.add_argument("-p", "--provider", default="shm")
    p.add_argument("--sizes", default="64K", help="comma-separated, K/M/G (default 64K)")
    p.add_argument("--gpus", help="SERVER,CLIENT GPU numbers: GPU memory (default: host)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bytes", type=cli.parse_size, default=4 << 30,
                   help="bytes moved per run (default 4G; at least 200 operations)")
    p.add_argument("--label", type=cli.parse_label, default=os.uname().nodename,
                   help="machine name for the file")
    p.add_argument("--timeout", type=float, default=120)
    p.add_argument("--results", default=str(bench.RESULTS),
                   help="folder to write into (default: the repository's results/)")
    return p


def parse(p):
    args = p.parse_args()
    try:
        args.sizes = [cli.parse_size(s) for s in args.sizes.split(",")]
        args.gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    except (ValueError, argparse.ArgumentTypeError) as e:
        p.error(str(e))
    if args.gpus and len(args.gpus) != 2:
        p.error("--gpus takes two GPU numbers: SERVER,CLIENT")
    return args


def chapter_list(p, text, allowed):
    """'9,13' -> [9, 13]; anything but chapters of `allowed` is one line from argparse."""
    parts = text.split(",")
    if not all(c.isdigit() and int(c) in allowed for c in parts):
        p.error(f"--chapters takes chapter numbers like 13,15, each one of "
                f"{','.join(map(str, sorted(allowed)))}; got '{text}'")
    return [int(c) for c in parts]


# --- a chapter, measured as the tools are ------------------------------------

WINDOW = 64  # distinct pages, as fi_rma_bw's default window


def chapter_args(chapter, size, iters, nics, groups=1, gpus=None, client_gpus=None):
    """The server's and the client's arguments for one run of a chapter (the server's
    --clients and --json aside). Chapters 09 on: `nics` per GPU (None: the chapter's
    default), and with host memory `groups` stand-ins for GPUs. `gpus`: the server's,
    `client_gpus`: the client's (default the same)."""
    client_gpus = client_gpus or gpus
    server = []
    client = ["--page-size", str(size), "--buffers", "1", "--buffer-size", str(WINDOW * size),
              "--pages", f"0-{WINDOW - 1}", "--iters", str(iters), "--timeout", "30"]
    if chapter >= 9:
        client += (["--nics-per-gpu", str(nics)] if nics else []) + \
            ([] if gpus else ["--groups", str(groups)])
    if gpus and chapter < 9:
        server += ["--gpu", str(gpus[0])]
        client += ["--gpu", str(client_gpus[0])]
    elif gpus:
        server += ["--gpus", ",".join(map(str, gpus))]
        client += ["--gpus", ",".join(map(str, client_gpus))]
    return server, client


def run_chapter(chapter, provider, size, iters, gpus, nics, timeout, groups=1):
    """One run of a chapter as a pair; the server's Gbps, from its --json record.
    Chapters 09 on: `nics` per GPU, and with host memory `groups` stand-ins for GPUs.
    With GPUs A,B, 09 on put buffers on both GPUs and each GPU writes to the other:
    all over NVLink."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        server, client = chapter_args(chapter, size, iters, nics, groups, gpus,
                                      gpus and gpus[::-1])
        server += ["--clients", "1", "--json", str(out)]
        pair = run_chapter_pair(chapter, provider, server, [client], timeout=timeout)
        if not pair.ok or not out.exists():
            failed = next((r for r in [*pair.clients, pair.server] if r.rc), pair.server)
            raise RuntimeError(f"chapter {chapter:02d} failed: "
                               f"{(failed.err or failed.out).strip()[-300:]}")
        return json.loads(out.read_text())["gbps"], " ".join(client)

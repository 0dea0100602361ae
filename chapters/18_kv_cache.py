"""Chapter 18 - kv_cache: a prefill process hands its KV cache to a decode process, layer by layer.

What you will learn: how disaggregated serving moves a prompt's KV cache, and why it costs
almost nothing when the transfer hides behind compute. The decoder (the server) keeps a
paged KV cache (a shard's page of a layer's K or V is one contiguous run: one WRITE) and
sends the prefiller (the client) its cache's descriptor and the indices of free pages. The
prefiller runs the prompt layer by layer (real matrix products of a named model's layer,
bf16 on a GPU's tensor cores); after each layer a watcher thread issues that layer's paged
WRITEs, every page carrying one immediate that names the request and the layer. The
decoder waits by count (as many immediates of that value as the layer has pages, in any
order, from any NIC), then takes the last token's hidden state in one WRITE and checks
every byte. The cell "Layer by layer" below has the details.

New since chapters 09-15: what they add up to, made reusable as common/transfer: one C
worker per GPU posting lazily in batches over its NICs, memory registered once as a
descriptor a peer can use, paged WRITEs with immediates (a request's layer-0 command
prepared once, each layer writing it shifted), completion by count, control messages. The
prompt's compute (the model's layers, bf16 on the tensor cores) and the report are in
common/kv_cache/, not the lesson.

    .venv/bin/python chapters/18_kv_cache.py                  # the decoder: prints its address
    .venv/bin/python chapters/18_kv_cache.py -p shm ADDRESS   # the prefiller, as it prints
    .venv/bin/python scripts/pair.py 18                       # both, on this host
    .venv/bin/python scripts/pair.py 18 --server-args="--tokens 2048" -- --tokens 2048
    .venv/bin/python scripts/pair.py 18 --server-args="--cancel-after 3"   # cancelled mid-way
    .venv/bin/python scripts/pair.py 18 --server-args="--gpu 0" -- --gpu 0  # GPU memory, cupy

Transcripts (a 2-core VM; one H200) and figures: results/18_kv_cache/README.md
"""
# LESSON: this chapter's figure and where it moves; scripts/tour.py says how it is read.
LESSON = {"figure": "check"}

# %% [markdown]
# ## Layer by layer
# The decoder (the server) keeps a paged KV cache: pages of --page-tokens tokens, each page
# of a layer's K or V one contiguous run of bytes (the shard's KV heads before the pages'
# tokens, so a shard's page is one WRITE). For a request it picks free pages and sends the
# prefiller (the client) its cache's descriptor and their indices. The prefiller runs the
# prompt layer by layer (real matrix products of one transformer layer's size, the shapes
# of a named model); after each layer the compute side bumps a counter, and a watcher
# thread that sees it issues that layer's paged WRITEs, every page carrying one immediate
# value that names the request and the layer. The decoder waits by count (expect: as many
# immediates of that value as the layer has pages, in any order, from any NIC), so it only
# ever uses a page set whose WRITEs all arrived; then the last token's hidden state comes
# as one WRITE, and the decoder checks every byte against what it computes from the same
# seeds. On a 2-core VM (host memory, shm) the layer is the same model's, scaled down; the
# lesson shows there too: every layer's transfer but the last runs while the next one
# computes. On a GPU the products run as a real prefill's do: bf16 inputs, float32
# accumulation, on the tensor cores (--dtype bf16, the default with --gpu); --dtype fp32
# keeps float32 throughout, the host's only choice. Both sides compute in the same dtype:
# the decoder recomputes the prompt to check every byte.

# %% [markdown]
# ## Inside one node, a NIC is the wrong path
# A decoder on the same host as its prefiller (one 8-GPU box split into a prefill and a
# decode instance) need not go through a NIC at all: when both caches are GPU memory, the
# engine maps the decoder's cache into the prefiller by CUDA IPC and copies each layer's
# pages with one kernel (`peer.route == "cuda-ipc"`, common/transfer/ipc.py); libfabric's
# shm makes one CUDA IPC copy per WRITE. The same calls, expect() unchanged. On one H200
# (both on GPU 0, libfabric 2.6, 10,000 pages of 16 KiB in one command,
# scripts/transfer_bench.py --gpu 0, runs minutes apart): 9,942 Gbps by the kernel route,
# 31.5 by shm, 23.4 by NIXL, and the GPU gathering them alone at 16,306; a prepared
# command, as this chapter sends (its table already on the GPU: one launch a layer),
# 13,611-14,184 Gbps, 83-87% of its run's gather (results/transfer/README.md: the
# commands, and where the rest goes). --no-cuda-ipc takes the NIC's path, for comparison.

# %% [markdown]
# ## Motivation
#     decoder (server)                               prefiller (client)
#     free pages for the request -- REQUEST ------>  (descriptor, page indices)
#                                                    layer 0: compute K, V; bump counter
#                                                      watcher: paged WRITEs, imm (req, 0)
#     expect(imm (req, 0), pages) <------------------  ... while layer 1 computes ...
#     ...                                            layer L-1, then the context: 1 WRITE
#     expect(context) -------------------- DONE --->  timings back to the decoder
#     check every byte, layer by layer -- CHECKING ->  (each layer: the decoder is there)
#                                      -- CHECKED -->  the wrong bytes found
#     (or CANCEL -> the prefiller stops, waits for its WRITEs, CANCELLED -> pages freed)

# %%
import common  # first: a Ctrl-C during the imports below is one line (common/bounds.py)
import json
import os
import struct
import sys
import threading
import time

import numpy as np

from common import bounds, cli
import common.fabric as fi
from common.fabric import memory
from common.gpu import INCLUDE
from common.kv_cache.prefill import MODELS, Layers, Shape, describe, prefill_alone
from common.kv_cache.report import per_layer, record, say, summary
from common.transfer import Engine

KERNELS = os.path.splitext(os.path.abspath(__file__))[0] + ".cu"  # the GPU's counter bump

CONTEXT = 255  # the immediate's layer field for the last token's hidden state
REQUEST, CANCEL, CANCELLED, DONE, CHECKING, CHECKED = (
    b"REQ", b"CAN", b"CAD", b"DON", b"CKG", b"CHK")


# %% [markdown]
# ## Code

# %%
def imm(request, layer):
    """The immediate of a request's layer: 24 bits of request, 8 of layer (32 on EFA)."""
    return (request & 0xFFFFFF) << 8 | layer


def now():
    return time.perf_counter()


# --- the decoder (server) -------------------------------------------------------------
def decoder(args, s, xp):
    with fi.Closer() as own:
        eng = Engine(own, args.provider, gpu=args.gpu, nics=args.nics, timeout=args.timeout,
                     cuda_ipc=not args.no_cuda_ipc)
        slots = args.cache_pages or 2 * s.pages     # per (layer, K|V): room for two requests
        cache = xp.zeros((s.layers * 2 * slots, s.page_bytes), xp.uint8)
        context = xp.zeros((1, s.hidden), xp.float32)
        pages, ctx = eng.register(cache), eng.register(context)
        print(f"provider: {eng.provider}; {eng.nics}")
        print(f"decoder: KV cache of {slots} pages a (layer, K|V), {s.layers} layers, "
              f"{s.page_bytes} B a page ({cache.nbytes / 2**20:.0f} MiB); "
              f"model {s.model} ({describe(s)})", flush=True)
        args.provider_used = eng.provider.split(";")[0]
        print(f"server address: {eng.address().hex()}")
        print(cli.client_hint(args, eng.address().hex(), extra=shape_flags(args)), flush=True)
        peer = None
        while peer is None:  # what is not a prefiller's request is said, and the wait goes on
            peer = prefiller_of(eng, eng.recv(args.timeout * 10)[1])
        request, first = 1, 0                          # its pages: slots first..first+pages
        started = now()
        eng.send(peer, REQUEST + json.dumps({
            "request": request, "first": first, "slots": slots, "tokens": s.tokens,
            "dtype": s.dtype, "cache": pages.descriptor().hex(),
            "context": ctx.descriptor().hex()}).encode())
        print(f"decoder: request {request} asks for {s.pages} pages a (layer, K|V), slots "
              f"{first}..{first + s.pages - 1}", flush=True)
        for layer in range(s.layers):
            try:
                eng.expect(imm(request, layer), 2 * s.pages, args.timeout)
            except TimeoutError as e:
                raise TimeoutError(f"layer {layer} of request {request}: {e} (is the "
                                   "prefiller still there?)") from None
            if args.cancel_after is not None and layer == args.cancel_after:
                return cancel(eng, peer, request, layer, args)
        eng.expect(imm(request, CONTEXT), 1, args.timeout)
        ttft = now() - started
        eng.send(peer, DONE + struct.pack("<d", ttft))
        _, report = eng.recv(args.timeout)
        # the check computes the prompt again, longer than --timeout for a long prompt: a
        # sign of life after each layer keeps the prefiller's wait for the verdict bounded
        wrong = check(s, args.seed, xp, cache, slots, first, context,
                      lambda: eng.send(peer, CHECKING))
        eng.send(peer, CHECKED + struct.pack("<Q", wrong))
        say(s, json.loads(report), ttft, wrong)
        return 1 if wrong else 0


def prefiller_of(eng, hello):
    """The peer whose request `hello` is, connected; None, said in one line, where it is not
    a request with an engine's address (another program's message, a lie)."""
    try:
        if not hello.startswith(REQUEST):
            raise ValueError("not a request")
        return eng.connect(hello[len(REQUEST):])
    except (ValueError, fi.FabricError) as e:
        print(f"ignored a {len(hello)}-byte message: {e}", file=sys.stderr, flush=True)
        return None


def cancel(eng, peer, request, layer, args):
    """The decoder gives a request up: its pages are free once the prefiller says it will
    write no more into them (its WRITEs in flight have completed)."""
    eng.send(peer, CANCEL + struct.pack("<I", request))
    _, answer = eng.recv(args.timeout)
    if answer != CANCELLED + struct.pack("<I", request):
        raise ValueError(f"the prefiller answered {answer[:3]!r} to the cancel")
    print(f"request {request} cancelled after layer {layer}: the prefiller confirmed, its "
          "pages are free again", flush=True)
    return 0


def check(s, seed, xp, cache, slots, first, context, checked):
    """Wrong bytes in the request's pages and context, against the same layers run here;
    `checked()` after each layer."""
    layers, out = Layers(s, seed, xp), xp.empty((2, s.pages, s.page_bytes), xp.uint8)
    wrong = 0
    for layer in range(s.layers):
        layers.step(layer, out)
        got = cache[s.page_set(layer, first, s.pages, slots)]
        wrong += int((got != out.reshape(2 * s.pages, -1)).sum())
        checked()
    return wrong + int((context.view(xp.uint8) != layers.context().view(xp.uint8)).sum())


def shape_flags(args):
    """The flags the prefiller must be given as the decoder was (the same prompt, layers)."""
    given = [(f"--{name.replace('_', '-')}", getattr(args, name))
             for name in ("model", "layers", "tokens", "page_tokens", "gpu", "dtype")]
    return [str(v) for flag, value in given if value is not None for v in (flag, value)]


# --- the prefiller (client) -------------------------------------------------------------
class Counter:
    """How many layers are done, in host memory: bumped by the compute side (the GPU itself,
    a one-thread kernel behind each layer, or the host after a layer on numpy), with the
    time of each bump on the host's clock: the GPU's globaltimer, mapped onto ours by two
    readings of both clocks, one before the prompt and one after (calibrate): over a
    128K-token prompt (22 s on one H200) one reading, before, gave a median watcher latency
    of -52 us; the two clocks drift apart. With both readings: 47 us."""

    def __init__(self, layers, xp):
        self.xp, self.layers = xp, layers
        if xp is np:
            self.value, self.when = np.zeros(1, np.int64), np.zeros(layers + 1)
            return
        import cupyx  # pinned host memory, mapped: the kernel writes it at the same address
        self.value, self.mark = cupyx.zeros_pinned(1, np.int64), cupyx.zeros_pinned(1, np.int64)
        self.ns = cupyx.zeros_pinned(layers + 1, np.uint64)  # the last: for calibrating
        kernels = xp.RawModule(code=open(KERNELS).read(), options=(INCLUDE,))
        self.kernel = kernels.get_function("kv_bump")
        self.clocks = []
        self.calibrate()

    def _launch(self, counter, value):
        self.kernel((1,), (1,), (np.uintp(counter.ctypes.data), np.int64(value),
                                 np.uintp(self.ns.ctypes.data)))

    def calibrate(self, patience=10.0):
        """One reading of both clocks, with the GPU idle: a bump of a counter of its own,
        seen by polling (a microsecond or two late, the same each time)."""
        if self.xp is np:
            return
        self.xp.cuda.get_current_stream().synchronize()
        self.mark[0] = 0
        self._launch(self.mark, self.layers + 1)
        deadline = now() + patience
        while int(self.mark[0]) == 0:
            if now() > deadline:
                raise TimeoutError(f"the GPU ran no kernel within {patience:g} s")
        self.clocks.append((now(), 1e-9 * float(self.ns[self.layers])))

    def bump(self, layers_done):
        if self.xp is np:
            self.when[layers_done - 1] = now()
            self.value[0] = layers_done  # one writer: this store is what the watcher reads
        else:
            self._launch(self.value, layers_done)  # queued behind the layer; the host goes on

    def done(self):
        return int(self.value[0])

    def bumped(self, layer):
        """When layer `layer` was done, on our clock."""
        if self.xp is np:
            return float(self.when[layer])
        (t0, g0), (t1, g1) = self.clocks[0], self.clocks[-1]
        rate = (t1 - t0) / (g1 - g0) if g1 > g0 else 1.0
        return t0 + rate * (1e-9 * float(self.ns[layer]) - g0)


class Watcher(threading.Thread):
    """Sees the counter move and issues that layer's paged WRITEs, so that the compute never
    waits for the network; stops issuing once the request is cancelled."""

    def __init__(self, eng, peer, s, counter, stage, request, cache, slots, first, timeout):
        super().__init__(daemon=True)
        self.eng, self.peer, self.s, self.counter, self.stage = eng, peer, s, counter, stage
        self.timeout, self.progress = timeout, now()
        self.request, self.cache, self.slots, self.first = request, cache, slots, first
        self.posted, self.done = [], []
        self.transfers, self.error, self.cancelled = [], None, False

    def run(self):
        try:
            self._run()
        except Exception as e:  # said by the main thread, in one line
            self.error = e

    def _run(self):
        s, seen = self.s, 0
        # Layer l's pages are layer 0's, 2*l pages on at each end (K and V): one command,
        # checked (and on the CUDA IPC route put on the GPU) once, written shifted per layer
        layer0 = self.eng.prepare_pages(
            self.peer, self.stage, s.page_set(0, 0, s.pages, s.pages), self.cache,
            s.page_set(0, self.first, s.pages, self.slots), s.page_bytes)
        while seen < s.layers and not self.cancelled:
            self._reap()
            if self.counter.done() == seen:
                time.sleep(20e-6)
                continue
            if len(self.done) == len(self.transfers):  # nothing in flight: the clock starts
                self.progress = now()
            self.posted.append(now())
            self.transfers.append(layer0.write(imm(self.request, seen),
                                               src_shift=2 * seen * s.pages,
                                               dst_shift=2 * seen * self.slots))
            seen += 1
        while len(self.done) < len(self.transfers):
            self._reap()
            time.sleep(20e-6)

    def _reap(self):
        while len(self.done) < len(self.transfers) and self.transfers[len(self.done)].done:
            self.transfers[len(self.done)].wait()  # raises what went wrong
            self.progress = now()
            self.done.append(self.progress)
        if len(self.done) < len(self.transfers) and now() - self.progress > self.timeout:
            raise TimeoutError(f"layer {len(self.done)}'s WRITEs did not complete within "
                               f"{self.timeout:g} s: is the decoder still there?")


def prefiller(args, s, xp, addr):
    with fi.Closer() as own:
        eng = Engine(own, args.provider, gpu=args.gpu, nics=args.nics, timeout=args.timeout,
                     cuda_ipc=not args.no_cuda_ipc)
        try:  # a wrong address is said before anything is computed
            server = eng.connect(addr)
        except ValueError as e:  # said to the program; to the reader, who pasted the address:
            raise cli.UsageError(f"{str(e).split(': ')[0]}: copy the whole address that the "
                                 "decoder printed, and give both the same -p and --nics") from None
        print(f"provider: {eng.provider}; {eng.nics}; pages to the decoder by "
              f"{server.route} ({server.why})")
        print(f"prefiller: {describe(s)}", flush=True)
        # all that a serving engine has ready before a request comes: weights, staging
        # (registered once), and here the time the prompt takes without any transfer
        layers, alone = Layers(s, args.seed, xp), prefill_alone(s, args.seed, xp, args.gpu)
        stage = xp.zeros((s.layers, 2, s.pages, s.page_bytes), xp.uint8)
        staged, counter = eng.register(stage), Counter(s.layers, xp)
        eng.send(server, REQUEST + eng.address())
        ask = json.loads(heard(eng, args.timeout, "the request")[len(REQUEST):])
        if ask["tokens"] != s.tokens:
            raise ValueError(f"the decoder runs {ask['tokens']} tokens, we {s.tokens}: give "
                             "both the same --tokens")
        if ask["dtype"] != s.dtype:  # its check would find every byte wrong
            raise ValueError(f"the decoder computes in {ask['dtype']}, we in {s.dtype}: give "
                             "both the same --dtype (and --gpu)")
        request = ask["request"]
        cache, context_at = (eng.remote(bytes.fromhex(ask[k])) for k in ("cache", "context"))
        watcher = Watcher(eng, server, s, counter, staged, request, cache, ask["slots"],
                          ask["first"], args.timeout)
        watcher.start()
        start = now()
        for layer in range(s.layers):  # on a GPU this only queues: the kernels bump
            layers.step(layer, stage[layer])
            counter.bump(layer + 1)
            if watcher.error:  # the decoder is gone: computing on would only delay saying so
                raise watcher.error
            if cancelled(eng, request):
                return stop(eng, server, watcher, request, layer)
        context = xp.ascontiguousarray(layers.context())
        ctx = eng.register(context)
        while watcher.is_alive():
            if cancelled(eng, request):
                return stop(eng, server, watcher, request, counter.done() - 1)
            time.sleep(1e-4)
        if watcher.error:
            raise watcher.error
        memory.synchronize(args.gpu)  # the context's last kernels
        eng.write(server, ctx, 0, context_at, 0, context.nbytes,
                  imm=imm(request, CONTEXT)).wait(args.timeout)
        answer = heard(eng, args.timeout, "the decoder's DONE")
        if not answer.startswith(DONE):
            raise ValueError(f"the decoder answered {answer[:3]!r}")
        counter.calibrate()  # the second reading of both clocks: the GPU is idle now
        compute = [counter.bumped(k) for k in range(s.layers)]
        watch = [posted - bumped for posted, bumped in zip(watcher.posted, compute)]
        figures = summary(s, start, compute, watcher.posted, watcher.done, watch, alone)
        figures["route"] = server.route
        eng.send(server, json.dumps(figures).encode())
        verdict = heard(eng, args.timeout, "the decoder's check")
        while verdict == CHECKING:  # one layer checked: the wait starts again
            verdict = heard(eng, args.timeout, "the decoder's check")
        wrong = struct.unpack("<Q", verdict[len(CHECKED):])[0]
        print(f"prefiller: {s.layers} layers sent, {2 * s.layers * s.pages} pages; "
              f"{eng.stats()}; the decoder found {wrong} wrong bytes", flush=True)
        if args.json:
            layers_of = per_layer(start, compute, watcher.posted, watcher.done, watch)
            ttft = struct.unpack("<d", answer[len(DONE):])[0]
            print(f"result: {record(args, eng, s, figures, layers_of, ttft, wrong)}")
        return 0


def heard(eng, timeout, what):
    """The decoder's next message, within `timeout`; a wait that ends says for what."""
    try:
        return eng.recv(timeout)[1]
    except TimeoutError as e:
        raise TimeoutError(f"{what}: {e} (is the decoder still there?)") from None


def cancelled(eng, request):
    try:
        _, message = eng.recv(0)
    except TimeoutError:
        return False
    return message == CANCEL + struct.pack("<I", request)


def stop(eng, server, watcher, request, layer):
    wind_down(watcher)
    if watcher.error:
        raise watcher.error
    eng.send(server, CANCELLED + struct.pack("<I", request))
    print(f"prefiller: request {request} cancelled by the decoder (layer {layer} computed); "
          "its WRITEs completed, staging freed", flush=True)
    return 0


def wind_down(watcher):
    """Stop a watcher once its WRITEs in flight have completed: no more bytes then land in
    the pages the decoder frees. They may take longer than a thread's usual second (big
    layers, a busy peer): it is given as long as they complete, and fails --timeout after
    the last; one still there past that is stuck (bounds.join ends the process)."""
    watcher.cancelled = True
    while watcher.is_alive() and now() - watcher.progress <= watcher.timeout:
        watcher.join(0.05)
    bounds.join([watcher], "the transfer watcher")


def main():
    p = cli.parser(__doc__)
    cli.add_peer(p)
    p.add_argument("--gpu", type=int, help="GPU memory and cupy on this GPU (both sides)")
    p.add_argument("--model", choices=list(MODELS), help="the layer's shapes (default: "
                   "qwen3-235b-tp4 on a GPU, small on the host)")
    p.add_argument("--layers", type=cli.count(1, 254), help="fewer layers than the model has")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="the matrix products: bf16 on "
                   "the GPU's tensor cores (the default with --gpu) or float32 (the host's)")
    p.add_argument("--tokens", type=cli.count(1, 1 << 20), default=None,
                   help="prompt tokens (default 4096 on a GPU, 1024 on the host)")
    p.add_argument("--page-tokens", type=cli.count(1, 4096), default=128)
    p.add_argument("--cache-pages", type=cli.count(1, 1 << 20),
                   help="decoder: pages a (layer, K|V) in its cache (default: two requests)")
    cli.add_engine(p)
    p.add_argument("--seed", type=int, default=18)
    cli.side("client", p.add_argument("--json", nargs="?", const="auto", help="write the run "
                                      "as JSON to this file (default results/runs/...)"))
    cli.side("server", p.add_argument("--cancel-after", type=int, help="cancel the request "
                                      "once this layer has arrived"))
    args = p.parse_args()
    args.model = args.model or ("qwen3-235b-tp4" if args.gpu is not None else "small")
    tokens = args.tokens or (4096 if args.gpu is not None else 1024)
    if args.dtype == "bf16" and args.gpu is None:
        raise cli.UsageError("--dtype bf16 needs --gpu: the host (numpy) computes in fp32")
    s = Shape(args.model, tokens, args.page_tokens,
              args.dtype or ("bf16" if args.gpu is not None else "fp32"))
    if args.layers:
        s.layers = args.layers
    if args.cache_pages is not None and args.cache_pages < s.pages:
        raise cli.UsageError(f"--cache-pages {args.cache_pages}: a request of {tokens} "
                             f"tokens needs {s.pages}")
    if args.cancel_after is not None and not 0 <= args.cancel_after < s.layers - 1:
        raise cli.UsageError(f"--cancel-after must be a layer 0..{s.layers - 2}")
    addr = cli.parse_address(args.address) if args.address else None
    xp = np
    if args.gpu is not None:
        xp = memory.cupy()
        memory.use_gpu(args.gpu)
    if addr is None:
        return decoder(args, s, xp)
    return prefiller(args, s, xp, addr)


if __name__ == "__main__":
    cli.run(main)

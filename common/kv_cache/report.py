"""What chapter 18's two sides report: the prefiller's timings in a few numbers (summary,
sent to the decoder), what the decoder prints of them (say), and the run's record
(--json: per_layer, record).
"""
import numpy as np

import common.fabric as fi
from common import bench, records
from common.kv_cache.prefill import describe


def summary(s, start, compute, posted, done, watch, alone):
    """The prefiller's timings in a few numbers (a control message holds no more): per
    layer the compute and the transfer, and how much of each layer's transfer ran while
    the next layer computed (the last has nothing to hide behind)."""
    compute, posted, done = np.array(compute), np.array(posted), np.array(done)
    transfer = done - posted
    hidden = np.clip(np.minimum(done[:-1], compute[1:]) - posted[:-1], 0, None) / \
        np.maximum(transfer[:-1], 1e-9)
    took = np.diff(np.concatenate([[start], compute]))
    return {"compute": float(np.median(took)), "transfer": float(np.median(transfer)),
            "hidden": float(np.median(hidden)) if len(hidden) else 0.0,
            "last": float(transfer[-1]), "watch50": float(np.percentile(watch, 50)),
            "watch99": float(np.percentile(watch, 99)), "alone": alone}


def say(s, t, ttft, wrong):
    print(f"per layer (median of {s.layers}): compute {1e3 * t['compute']:.2f} ms, "
          f"transfer {1e3 * t['transfer']:.2f} ms ({2 * s.pages} pages of {s.page_bytes} B "
          f"by {t['route']}, "
          f"{2 * s.pages * s.page_bytes * 8 / t['transfer'] / 1e9:.2f} Gbps); hidden behind "
          f"the next layer: {100 * t['hidden']:.0f}% (all but the last layer; the last "
          f"one's {1e3 * t['last']:.2f} ms is not)")
    print(f"watcher, counter to first post: p50 {1e6 * t['watch50']:.0f} us, "
          f"p99 {1e6 * t['watch99']:.0f} us")
    print(f"time to first token: {1e3 * t['alone']:.1f} ms prefill alone, "
          f"{1e3 * ttft:.1f} ms with the transfer ({s.tokens} tokens, {s.layers} layers)")
    print(f"checked {s.layers * 2 * s.pages} pages and the context: {wrong} wrong bytes",
          flush=True)


def per_layer(start, compute, posted, done, watch):
    """Each layer's times, for the record: its compute, its transfer, the watcher's delay."""
    took = np.diff(np.concatenate([[start], compute]))
    return {"compute_s": took.tolist(), "transfer_s": (np.array(done) - posted).tolist(),
            "watch_s": watch}


def record(args, eng, s, figures, layers_of, ttft, wrong):
    """The run as JSON: what ran, where, the summary and each layer's times."""
    path = bench.run_path(args.json, "18_kv_cache", s.model, f"{s.tokens}tokens")
    return records.write_json(path, {
        "chapter": "18_kv_cache", "args": records.arguments(), "provider": eng.provider,
        "libfabric": "%d.%d" % fi.version(), "machine": records.machine(args.gpu),
        "git": records.git_sha(), "memory": "cuda" if args.gpu is not None else "host",
        "model": s.model, "shape": describe(s), "dtype": s.dtype, "tokens": s.tokens,
        "layers": s.layers, "page_bytes": s.page_bytes, "pages_per_layer": 2 * s.pages,
        **figures, "ttft_s": ttft, "wrong_bytes": wrong, "per_layer": layers_of})

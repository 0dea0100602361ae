"""Chapter 17's all-to-all in a CUDA graph, as a serving engine replays one: the layer (both
halves of dispatch and of combine, the experts' outputs read from a buffer) captured once,
each replay given new inputs in the same buffers and checked against the reference, as
harness.check_case checks a round; then each half captured and its replays timed."""
import numpy as np

from common.moe import harness


def check(a2a, group, args, replays):
    """Capture one layer, replay it `replays` times with fresh inputs; rank 0 says what
    every rank saw."""
    cp, L, stream = a2a.xp, a2a.L, a2a.mem.stream
    seed = harness.agreed_seed(group, args)
    cases = [harness.case_inputs(L, group.rank, a2a.wire.dtype, "random", seed + i)
             for i in range(replays)]
    x, indices, weights, answers = (cp.asarray(a) for a in cases[0][:4])
    a2a.mem.ready()
    with stream:
        stream.begin_capture()
        a2a.dispatch_send(x, indices)
        tokens, scales, counts = a2a.dispatch_recv()
        a2a.combine_send(answers)
        out = a2a.combine_recv(weights)
        graph = stream.end_capture()
    wrong = 0
    for case in cases:
        for buffer, values in zip((x, indices, weights, answers), case[:4]):
            buffer.set(values, stream=stream)
        graph.launch(stream)
        a2a.check("a replay")
        host = a2a.mem.host
        ok, _ = harness.verdict(case, host(counts), host(tokens),
                                None if scales is None else host(scales), host(out))
        wrong += not ok
    every = group.allgather(wrong.to_bytes(4, "little"))
    bad = [r for r, w in enumerate(every) if int.from_bytes(w, "little")]
    if group.rank == 0:
        print(f"check graph {a2a.wire.dtype}: one layer captured, replayed {replays} times "
              f"with new inputs, each replay exact on {group.world - len(bad)} of "
              f"{group.world} ranks" + (f"; FAILED on ranks {bad}" if bad else ""), flush=True)
    if bad:
        raise ValueError(f"replays went wrong on ranks {bad} (seed {seed}: --seed {seed} "
                         "repeats them)")


def benchmark(a2a, group, args, tokens):
    """Dispatch and combine each captured as a graph at `tokens` tokens, replayed; rank 0
    prints the medians (of each rank, then across ranks)."""
    cp, L, stream, mem = a2a.xp, a2a.L, a2a.mem.stream, a2a.mem
    x, indices, weights, _ = (cp.asarray(a) for a in harness.case_inputs(
        L, group.rank, a2a.wire.dtype, "random", args.seed, tokens)[:4])
    expert_out = cp.zeros((L.world * L.per_peer, L.hidden), cp.float32)
    with stream:
        graphs = []
        for half in (lambda: (a2a.dispatch_send(x, indices), a2a.dispatch_recv()),
                     lambda: (a2a.combine_send(expert_out), a2a.combine_recv(weights))):
            stream.begin_capture()
            half()
            graphs.append(stream.end_capture())
    times = []
    mem.ready()
    group.barrier()
    for i in range(args.warmup + args.iters):
        t0 = mem.mark()
        graphs[0].launch(stream)
        t1 = mem.mark()
        graphs[1].launch(stream)
        t2 = mem.mark()
        if i >= args.warmup:
            times.append((mem.seconds(t0, t1), mem.seconds(t1, t2)))
    a2a.check("the replays")
    medians = np.median(np.array(times), axis=0)
    every = np.array([np.frombuffer(b, np.float64) for b in group.allgather(medians.tobytes())])
    if group.rank == 0:
        print(f"graph replays, {tokens} tokens per rank, the median of each rank, then across "
              "ranks:")
        for name, col in zip(("dispatch", "combine"), every.T):
            print(f"  {name:<14} p50 {1e6 * np.median(col):9.1f} us   max "
                  f"{1e6 * col.max():9.1f} us", flush=True)
        return {"implementation": "ours, CUDA graphs", "tokens": tokens,
                "dispatch_p50_us": 1e6 * float(np.median(every[:, 0])),
                "combine_p50_us": 1e6 * float(np.median(every[:, 1]))}
    return None

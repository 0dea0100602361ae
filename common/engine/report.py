"""What a run of chapters 09-15 showed: the WRITEs each NIC carried, the figures against
the limit of this machine and provider, and the --json record."""
from common import bench


def report(args, lanes, sources, iters, page_size, elapsed, cpu, sent, more):
    """What the run showed, printed; with --json also recorded, with the client's flags
    (`sent`) and the engine's own figures (`more`: its workers, chapter 10's warmup)."""
    done = [lane.queue.completed for lane in lanes]
    if sum(done) != iters or any(d != lane.iters for d, lane in zip(done, lanes)):
        raise ValueError(f"completions per NIC {done}, expected {[l.iters for l in lanes]}")
    print(f"wrote from {len(sources)} x {' / '.join(sorted({s.kind for s in sources}))}; "
          f"WRITEs per NIC: "
          f"{' '.join(map(str, done))}, each NIC's last with immediate data; "
          f"-FI_EAGAIN {sum(lane.queue.eagain for lane in lanes)} times")
    f = bench.figures(iters, page_size, elapsed)
    f["cpu_us_per_write"] = 1e6 * cpu / iters  # in the --json record too
    f.update({"workers": 1, **more}, nics=len(lanes), groups=len(sources),
             writes_per_nic=done, refused=sum(lane.queue.eagain for lane in lanes))
    memory_kind = "cuda" if args.gpus else "host"
    here = bench.machine(args.gpus[0] if args.gpus else None)
    # GPUs writing to each other: what NVLink carries both ways at once is the ceiling
    both_ways = args.gpus and len(set(args.gpus)) == 2
    lim = bench.limit([lane.info for lane in lanes], args.provider_used, memory_kind,
                      page_size, here, "cudaMemcpyPeer both ways" if both_ways else "fi_rma_bw")
    print(bench.summary(f, lim))
    # what the writer's threads spend per WRITE, polling included: it moves on a small
    # machine where the Gbps is noise (chapter 11's C loop against Python's)
    print(f"CPU time: {f['cpu_us_per_write']:.2f} us per WRITE (this process, all threads)",
          flush=True)
    if args.json:
        path = bench.run_path(args.json, args.chapter, args.provider_used, memory_kind,
                              f"{len(lanes)}nics", page_size)
        record = bench.record(path, args.chapter, args, lanes[0].info, memory_kind, here, f, lim,
                              sent, args.lesson["field"])
        print(f"result: {record}")

"""Baselines: what tools a user would reach for get on this machine, per size.

    .venv/bin/python scripts/baseline.py -p shm --sizes 64K,1M                  # host memory
    .venv/bin/python scripts/baseline.py -p shm --sizes 1M,16M --gpus 0,1 --ucx DIR

- fabtests `fi_rma_bw -o write` and `-o writedata` between two processes on
  this host (from LIBFABRIC_PREFIX/bin, else .deps/libfabric/bin, built by
  scripts/build_libfabric.sh); shm needs -E (address exchange over a socket).
  Note: with `-o write` both sides write at once; each reports its own
  direction. `writedata` is one way, like chapter 07.
- with GPU memory (--gpus SERVER,CLIENT): `-D cuda`, and UCX's
  `ucx_perftest -t ucp_put_bw -m cuda` (--ucx: the folder of the PyPI wheel
  libucx-cu13, unpacked), and cudaMemcpyPeer between the two GPUs: the ceiling.

Figures go to results/baselines/<label>-<provider>-<memory>.json (medians of
--repeats runs), with the machine and the libfabric of the tools; chapters find
them there, for the same machine, provider and libfabric version, to say what %
of the limit they reach. What a run needs (the provider, fi_rma_bw, GPUs, UCX)
is checked before anything runs; what was measured before a failure is kept.
"""
from common import usage
from common.baselines import baseline_tools, parse, parser, run_all, save


def main():
    p = parser(__doc__)
    p.add_argument("--ucx", help="unpacked libucx-cu13 wheel, for ucx_perftest (GPU only)")
    args = parse(p)
    run_all("baseline", args, baseline_tools(args.provider, args.gpus, args.ucx, args.timeout),
            lambda rows: save(rows, "baseline", args))


if __name__ == "__main__":
    usage.run(main)  # Ctrl-C: what runs is stopped, one line, exit 130

"""Start W ranks of a program on this host, as torchrun would, with emulated nodes.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun's
names), RANK_GPU (with --gpus) and RENDEZVOUS (the address of the rendezvous
this launcher serves); see common/launch/. Lines a rank prints come out as
"[rank] line". If a rank dies, the others are told and stop; the launcher says
which rank, how, and exits non-zero. Ctrl-C (or SIGTERM) stops every rank, and
the ranks die with the launcher, whatever kills it.

    .venv/bin/python scripts/launch.py -n 4 chapters/16_moe.py --device cpu
    .venv/bin/python scripts/launch.py -n 4 --ranks-per-node 2 chapters/16_moe.py -p tcp
    .venv/bin/python scripts/launch.py -n 2 --gpus 0,1 chapters/17_gpu_driven.py
"""
import argparse
import sys
from pathlib import Path

# Not common.cli's parser: that loads libfabric, whose providers may take over Ctrl-C,
# which the launcher must keep.
from common import usage
from common.launch import MAX_RANKS, spawn


def gpu_list(text):
    try:
        return [int(g) for g in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes numbers like 0,1, got '{text}'") from None


def main():
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--ranks", type=int, required=True,
                   help=f"how many ranks (world size), 1 to {MAX_RANKS}")
    p.add_argument("--ranks-per-node", type=int,
                   help="ranks per emulated node (default: all on one node)")
    p.add_argument("--gpus", type=gpu_list, help="GPUs to deal out to the ranks, round robin "
                   "(ranks share a GPU when there are fewer)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the others get to stop by themselves after a rank fails")
    p.add_argument("program", help="the Python program each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args()
    if args.ranks < 1:
        p.error(f"-n must be at least 1, got {args.ranks}")
    if args.ranks > MAX_RANKS:  # each rank is a process of this host, its cores shared
        p.error(f"-n {args.ranks}: at most {MAX_RANKS} ranks on one host (16 emulated "
                "nodes of 8 GPUs)")
    per_node = args.ranks if args.ranks_per_node is None else args.ranks_per_node
    if per_node < 1 or args.ranks % per_node:
        p.error(f"--ranks-per-node ({per_node}) must divide --ranks ({args.ranks})")
    if not 0 <= args.grace <= 600:
        p.error(f"--grace must be 0 to 600 seconds, got {args.grace:g}")
    if not Path(args.program).is_file():
        p.error(f"no program '{args.program}'")
    return spawn([args.program, *args.args], args.ranks, per_node, args.gpus, args.grace)


if __name__ == "__main__":
    sys.exit(main())

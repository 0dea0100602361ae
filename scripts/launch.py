"""Start W ranks of a program on this host, as torchrun would, with emulated nodes.

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun's
names), RANK_GPU (with --gpus) and RENDEZVOUS (the address of the rendezvous
this launcher serves); see common/launch.py. Lines a rank prints come out as
"[rank] line". If a rank dies, the others are told and stop; the launcher says
which rank, how, and exits non-zero.

    .venv/bin/python scripts/launch.py -n 4 chapters/16_moe.py --device cpu
    .venv/bin/python scripts/launch.py -n 4 --ranks-per-node 2 chapters/16_moe.py -p tcp
    .venv/bin/python scripts/launch.py -n 2 --gpus 0,1 chapters/17_gpu_driven.py
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.launch import spawn  # noqa: E402


class UsageError(ValueError):
    pass


class Parser(argparse.ArgumentParser):
    """One line for bad input, as the chapters do. (Not common.cli's: that loads
    libfabric, whose providers may take over Ctrl-C, which the launcher must keep.)"""

    def error(self, message):
        raise UsageError(message)


def gpu_list(text):
    try:
        return [int(g) for g in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes numbers like 0,1, got '{text}'") from None


def main():
    try:
        return launch()
    except UsageError as e:  # one line, like the chapters
        print(f"launch.py: error: {e}", file=sys.stderr)
        return 2


def launch():
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--ranks", type=int, required=True, help="how many ranks (world size)")
    p.add_argument("--ranks-per-node", type=int,
                   help="ranks per emulated node (default: all on one node)")
    p.add_argument("--gpus", type=gpu_list, help="GPUs to deal out to the ranks, round robin "
                   "(ranks share a GPU when there are fewer)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the others get to stop by themselves after a rank fails")
    p.add_argument("program", help="the Python program each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = p.parse_args()
    per_node = args.ranks_per_node or args.ranks
    if args.ranks < 1 or per_node < 1 or args.ranks % per_node:
        p.error(f"--ranks-per-node ({per_node}) must divide --ranks ({args.ranks})")
    if not Path(args.program).is_file():
        p.error(f"no program '{args.program}'")
    return spawn([args.program, *args.args], args.ranks, per_node, args.gpus, args.grace)


if __name__ == "__main__":
    sys.exit(main())

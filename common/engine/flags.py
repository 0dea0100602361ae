"""The flags of chapters 09-15, checked before anything is opened (common/engine/multinet.run
reads them; a chapter may add its own)."""
from common import cli
from common.fabric import memory


def parse(doc, add_args=None):
    """The arguments of chapters 09 on, checked before anything is opened."""
    p = cli.parser(doc)
    if add_args:
        add_args(p)
    cli.add_peer(p)
    cli.add_pages(p, pages="the first 1000 of each buffer", buffer_size=1 << 30, gpu=False)
    p.add_argument("--gpus", help="GPUs whose memory (and NICs) to use, e.g. 0,1")
    cli.side("client",
             p.add_argument("--groups", type=int, default=1,
                            help="without --gpus: how many GPUs to stand in for with host memory"),
             p.add_argument("--nics-per-gpu", type=int, help="NICs per GPU (default: all of "
                            "them; where there are none: virtual NICs, default 1)"),
             p.add_argument("--iters", type=int, default=1_000_000, help="WRITEs over all NICs"))
    cli.side("server", p.add_argument("--json", nargs="?", const="auto",
                                      help="write the figures as JSON"))
    args = p.parse_args()
    try:
        args.gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else None
    except ValueError:
        raise cli.UsageError(f"--gpus takes GPU numbers like 0,1, not '{args.gpus}'") from None
    groups = len(args.gpus) if args.gpus else args.groups
    nics = 1 if args.nics_per_gpu is None else args.nics_per_gpu
    if not 1 <= groups <= 64 or not 1 <= nics <= 64:
        raise cli.UsageError("--groups/--gpus and --nics-per-gpu must be 1..64")
    cli.check_pages(args, lambda per_buffer: [b * per_buffer + i for b in range(args.buffers)
                                              for i in range(min(1000, per_buffer))])
    lanes = groups * nics
    if not lanes <= args.iters < 1 << 32:
        raise cli.UsageError(f"--iters must be {lanes}..{(1 << 32) - 1}: at least one WRITE "
                             "per NIC")
    for gpu in reversed(args.gpus or []):  # each must exist; the first ends up current
        memory.use_gpu(gpu)

    args.groups = groups
    return args

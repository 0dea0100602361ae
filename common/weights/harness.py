"""What chapter 19 runs around its update: its main() (flags and their checks against the
job, the job's group), what rank 0 says of the run before the first update, the updates'
schedule, what every rank tells every other through the launcher's group (JSON, memory
regions), and --fail's rank that kills itself.
"""
import json
import os
import signal

import common.fabric as fi
from common import cli, launch
from common.transfer import Engine
from common.weights.model import MODELS, describe, model_config, versions_at
from common.weights.ops import CudaOps, HostOps

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                        "launch.py")
RENDEZVOUS = 30  # x --timeout: how long the layouts' exchange and the checks may take


def main(doc, chapter, kernels, run):
    """Chapter 19's main(): its flags, refused before anything is opened; both sides'
    models (the inference side's may differ: --inference-config); where quantising runs
    (numpy, or `kernels` on this rank's GPU); then the job's group and the transfer
    engine (chapter 18's), and in them the chapter's run(eng, group, args, trainers,
    model, inference_model, ops, gpu)."""
    p = cli.parser(doc)
    add_arguments(p)
    args = p.parse_args()
    place = launch.place_from_environment()
    trainers = check_arguments(args, place, chapter)
    model = model_config(args)
    inference_model = model_config(args, args.inference_config)
    gpu = place.gpu if place.gpu is not None else place.rank % place.ranks_per_node
    ops = CudaOps(gpu, kernels) if args.device == "cuda" else HostOps()
    # the rendezvous waits longer: ranks lay out gigabytes and check them between updates
    # (a rank that dies is still seen at once: its connection closes; one frozen, once
    # silent for --timeout)
    with launch.Group(place, RENDEZVOUS * args.timeout, args.timeout) as group, \
            fi.Closer() as own:
        gpu = gpu if args.device == "cuda" else None
        # every trainer may be writing into one inference rank at once (issue 46, 7)
        eng = Engine(own, args.provider, gpu=gpu, nics=args.nics, timeout=args.timeout,
                     cuda_ipc=not args.no_cuda_ipc, peers=max(1, group.world - 1))
        eng.watch(group.check)
        return run(eng, group, args, trainers, model, inference_model, ops, gpu)


def add_arguments(p):
    """The update's flags (beside cli.parser's -p and --timeout)."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: numpy and host memory (default); cuda: cupy and GPU memory, the "
                   "rank's GPU from scripts/launch.py --gpus, else its local rank")
    p.add_argument("--trainers", type=cli.count(1, 1024),
                   help="ranks 0..T-1 train, the others serve (default: two thirds)")
    p.add_argument("--model", choices=list(MODELS), default="qwen3-30b-a3b")
    p.add_argument("--layers", type=cli.count(1, 1024), help="fewer layers (default: all on "
                   "cuda, 1 on cpu)")
    p.add_argument("--experts", type=cli.count(1, 4096), help="fewer experts (default: all "
                   "on cuda, 8 on cpu)")
    p.add_argument("--vocab", type=cli.count(1, 1 << 22), help="a smaller vocabulary "
                   "(default: all on cuda, 8192 on cpu)")
    p.add_argument("--inference-config", default="", metavar="KEY=N,...",
                   help="the inference side's model differs (e.g. hidden=1024): refused")
    p.add_argument("--updates", type=cli.count(1, 255), default=2)
    p.add_argument("--naive", choices=("yes", "no"), default="yes",
                   help="also the naive way, after the last update (default yes)")
    p.add_argument("--staging", type=cli.parse_size, help="a cap on a trainer's staging "
                   "memory, two halves that each hold a layer's quantised rows (default: "
                   "just that)")
    p.add_argument("--fail", choices=("trainer", "inference"),
                   help="the last rank of that side kills itself in update 2")
    cli.add_engine(p)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument("--json", nargs="?", const="auto", help="write the run as JSON to this "
                   "file (default results/runs/...)")


def check_arguments(args, place, chapter):
    """Refuse bad flags in one line, before anything is opened (`chapter`: the file the
    job runs, for the command that starts it); fill in the defaults: on the host the model
    scaled down. Returns how many ranks train."""
    small = args.device == "cpu" and args.model == "qwen3-30b-a3b"
    args.layers = args.layers or (1 if small else None)
    args.experts = args.experts or (8 if small else None)
    args.vocab = args.vocab or (8192 if small else None)
    if place.world < 2:
        raise cli.UsageError("it takes trainers and inference ranks: "
                             + cli.command("-n", "3", cli.shown(chapter), program=LAUNCHER))
    trainers = args.trainers or max(1, (2 * place.world) // 3)
    if trainers >= place.world:
        raise cli.UsageError(f"--trainers {trainers} leaves no inference rank of "
                             f"{place.world}")
    if args.fail and args.updates < 2:
        raise cli.UsageError("--fail acts in update 2: give --updates 2 or more")
    return trainers


def say_setup(args, eng, peers, model, plan):
    """Rank 0 says who is who, the provider and its routes, and the model (scaled down?)."""
    trainers, inference = plan.trainers, len(plan.layouts)
    print(f"{trainers} trainer{'s' * (trainers > 1)} (bf16, FSDP dim-0 shards) -> "
          f"{inference} inference rank{'s' * (inference > 1)} (fp8 e4m3, 128 x "
          f"128 blocks; attention TP{inference}, experts EP{inference}); device "
          f"{args.device}; provider {eng.provider}; {eng.nics}", flush=True)
    routes = sorted({f"{p.route} ({p.why})" for p in peers.values()})
    print(f"pages between ranks by {'; '.join(routes)}", flush=True)
    full = MODELS[args.model]
    scaled = [f"{model[k]} of {full[k]} {k}" for k in ("layers", "experts", "vocab")
              if model[k] != full[k]]
    print(f"model {args.model}: {describe(model, plan.params)}"
          + (f" (scaled down: {', '.join(scaled)})" if scaled else ""), flush=True)


def updates(args, params):
    """(n, naive, each parameter's version) of each update: --updates of them, then, with
    --naive yes, the naive way on the last one's weights."""
    for n in range(1, args.updates + (2 if args.naive == "yes" else 1)):
        yield n, n > args.updates, versions_at(params, min(n, args.updates))


def everyone(group, value):
    """`value` from every rank, in rank order (as JSON)."""
    return [json.loads(x) for x in group.allgather(json.dumps(value).encode())]


def exchange(group, eng, regions):
    """Our regions ({name: Region, None where this rank has none}) to every rank; every
    rank's as {name: RemoteRegion}, None for our own."""
    ours = {name: r.descriptor().hex() for name, r in regions.items() if r is not None}
    return [None if k == group.rank else
            {name: eng.remote(bytes.fromhex(d)) for name, d in theirs.items()}
            for k, theirs in enumerate(everyone(group, ours))]


def fail_here(who, n):
    """--fail: this rank (`who`: "trainer 1", "inference rank 2") says so and kills itself
    mid-update n, as a crash would: no goodbye to anyone."""
    print(f"{who}: killing myself mid-update {n} (--fail {who.split()[0]})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

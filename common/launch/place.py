"""Who am I: a rank's Place (rank, world, node, GPU, where to meet), from the environment
(common/launch/__init__.py says which variables)."""
import os
from dataclasses import dataclass


@dataclass
class Place:
    rank: int
    world: int
    ranks_per_node: int
    gpu: int | None
    rendezvous: tuple   # (host, port)
    serve: bool         # this rank serves the rendezvous (rank 0 under torchrun/Slurm)
    source: str         # where the above came from, for the reader

    @property
    def node(self):
        return self.rank // self.ranks_per_node

    @property
    def nodes(self):
        return self.world // self.ranks_per_node


def _int(env, name):
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ValueError(f"environment variable {name} must be an integer, "
                         f"got {env.get(name)!r}") from None


def place_from_environment(env=None):
    """This process's Place, from our launcher's, torchrun's or Slurm's variables;
    one rank of one (nothing to rendezvous with) when none are set."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        per_node = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        source = "scripts/launch.py" if "RENDEZVOUS" in env else "torchrun variables"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        per_node = _int(env, "SLURM_NTASKS_PER_NODE") if "SLURM_NTASKS_PER_NODE" in env \
            else world
        source = "Slurm variables"
    else:
        return Place(0, 1, 1, None, None, False, "no launcher: one rank")
    if not 0 <= rank < world or per_node < 1 or world % per_node:
        raise ValueError(f"rank {rank} of world {world} with {per_node} ranks per node "
                         "does not make sense")
    gpu = int(env["RANK_GPU"]) if env.get("RANK_GPU", "").isdigit() else None
    if "RENDEZVOUS" in env:
        host, _, port = env["RENDEZVOUS"].rpartition(":")
        return Place(rank, world, per_node, gpu, (host, int(port)), False, source)
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise ValueError(f"{source} found, but no MASTER_ADDR and MASTER_PORT to meet at "
                         "(Slurm: export them in the job script, e.g. the first host of "
                         "SLURM_JOB_NODELIST and a free port)")
    return Place(rank, world, per_node, gpu, (env["MASTER_ADDR"], _int(env, "MASTER_PORT") + 1),
                 rank == 0, source)

"""Multi-process runs: who am I (rank, world, node, GPU), a rendezvous, and a launcher.

A rank learns its place from the environment, under the names torchrun uses
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or
those Slurm's srun sets (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NTASKS_PER_NODE; MASTER_ADDR and MASTER_PORT from the job script), so
a program started by either runs one rank per process on a real cluster. Our
own launcher (spawn, launcher.py; scripts/launch.py) sets the torchrun names for W
ranks on this host, where `--ranks-per-node L` makes each block of L ranks an
emulated node, plus RANK_GPU and RENDEZVOUS (the address it serves).

The rendezvous is one TCP server: every rank connects, says who it is, and can
then `allgather` bytes (libfabric addresses, MR keys, shared-memory names,
CUDA IPC handles) and `barrier`. The launcher serves it itself; under
torchrun or Slurm, rank 0 serves it on MASTER_PORT + 1 (torchrun's own store
holds MASTER_PORT). The server also watches: a rank whose connection closes
before it said goodbye is gone (killed, crashed), and every other rank is
told so. Ranks ask (`check`, cheap, from their wait loops), so they stop
within a bounded time with a clear message instead of waiting forever. A
gather that runs out of time asks the rendezvous which ranks have not come
(an answer within LATE_ANSWER), so that its line names them.

A frozen rank (SIGSTOP, a host that stopped answering) closes nothing, so each
side also says that it lives, every ALIVE_EVERY seconds, from a thread of its
own: a rank that gave no sign of life for as long as it said at its join it
may be silent (its --timeout) stops the job as a dead one does, and a rank that
hears nothing from the rendezvous that long stops by itself. Before its join a
rank cannot say it; our launcher says it for each rank whose process runs (not
stopped), so one frozen at its start is seen the same way.

place: who am I; rendezvous: the messages and the server; group: a rank's side of it;
launcher: spawn and what it needs to own its ranks. This package re-exports the public names;
a test that changes a global patches the module that reads it, as a copy here is not read.
"""
from common.launch.group import Group
from common.launch.launcher import KILL_WAIT, MAX_RANKS, owned, spawn
from common.launch.place import Place, place_from_environment
from common.launch.rendezvous import FRAME, HELLO, LATE_ANSWER, WELCOME, PeerGone, RendezvousServer

__all__ = ["FRAME", "HELLO", "KILL_WAIT", "LATE_ANSWER", "MAX_RANKS", "WELCOME", "Group",
           "PeerGone", "Place", "RendezvousServer", "owned", "place_from_environment", "spawn"]

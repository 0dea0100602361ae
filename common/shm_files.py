"""Which files in /dev/shm a process of ours made, so that whoever outlives it can remove them.

A process that ends normally, or on Ctrl-C or SIGTERM, removes its own: libfabric's shm
provider unlinks an endpoint's region when the endpoint closes (prov/shm/src/smr_util.c,
smr_free), and the MoE chapters unlink their files once mapped. One that was SIGKILLed
removes nothing, so the launchers (common/launch.py, scripts/pair.py) and the tests remove
what it left, knowing the names:

- the shm provider names each endpoint's region "<pid>:<uid>:<n>" after the process that
  created it (prov/shm/src/smr_ep.c, smr_endpoint_name);
- a job's own files carry its name (common/moe/memory.py: "moe-<job>-<what>").

Standard library only: pair.py and the tests use it without loading libfabric.
"""
import re
from pathlib import Path

SHM = Path("/dev/shm")
REGION = re.compile(r"^(\d+):\d+:\d+")


def regions(pid=None):
    """The shm provider's regions in /dev/shm now (those of process `pid` only, if given)."""
    if not SHM.is_dir():
        return set()
    names = {p.name for p in SHM.iterdir() if REGION.match(p.name)}
    return names if pid is None else {n for n in names if creator(n) == pid}


def creator(name):
    """The pid that made the region `name`, or None if it is not a region's name."""
    match = REGION.match(name)
    return int(match[1]) if match else None


def job_files(job):
    """The files of job `job` (named after it) in /dev/shm now."""
    if not SHM.is_dir():
        return set()
    return {p.name for p in SHM.iterdir() if f"-{job}-" in p.name}


def remove_left_by(pids=(), job=None):
    """Remove the regions the processes `pids` made and, given `job`, that job's files:
    call it once those processes are gone (a live one would lose what it still uses)."""
    pids = set(pids)
    names = {n for n in regions() if creator(n) in pids} | (job_files(job) if job else set())
    for name in names:
        (SHM / name).unlink(missing_ok=True)
    return names

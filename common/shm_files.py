"""Which files in /dev/shm a process of ours made, so that whoever outlives it can remove them.

A process that ends normally, or on Ctrl-C or SIGTERM, removes its own: libfabric's shm
provider unlinks an endpoint's region when the endpoint closes (prov/shm/src/smr_util.c,
smr_free), and the MoE chapters unlink their files once mapped. One that was SIGKILLed
removes nothing, so the launchers (common/launch.py, scripts/pair.py), the tests and the
peer that outlives it (remove_dead_peers: a client its server's, a server its client's)
remove what it left, knowing the names:

- the shm provider names each endpoint's region "<pid>:<uid>:<n>" after the process that
  created it (prov/shm/src/smr_ep.c, smr_endpoint_name);
- a job's own files carry its name (common/moe/memory.py: "moe-<job>-<what>");
- an endpoint's address is its region's name after "fi_shm://" (smr_endpoint_name), so a
  peer knows whose regions to look for.

Standard library only: pair.py and the tests use it without loading libfabric.
"""
import re
from pathlib import Path

SHM = Path("/dev/shm")
REGION = re.compile(r"^(\d+):\d+:\d+")
PREFIX = b"fi_shm://"  # an shm endpoint's address (prov/shm/src/smr.h, SMR_PREFIX)
_peers = set()  # the pids of the shm peers this process put in an address vector


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
        try:
            (SHM / name).unlink(missing_ok=True)
        except PermissionError:  # another user's (a peer of theirs): not ours to remove
            pass
    return names


def met(address):
    """Note a peer's raw address (put in an address vector): if it is an shm endpoint's,
    its process is one whose regions remove_dead_peers may have to remove."""
    if address.startswith(PREFIX):
        pid = creator(address[len(PREFIX):].split(b"\0", 1)[0].decode(errors="replace"))
        if pid is not None:
            _peers.add(pid)


def remove_dead_peers():
    """Remove the regions of the shm peers met so far whose process has ended (a zombie
    too: it was killed, its parent has not read it yet); a live peer keeps its own."""
    return remove_left_by([pid for pid in list(_peers) if ended(pid)])


def ended(pid):
    """Whether process `pid` has ended: gone, or a zombie (only its parent has not read it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # the second: reaped between open and read
        return True

"""Which files in /dev/shm a process of ours made, so that whoever outlives it can remove them.

A process that ends normally, or on Ctrl-C or SIGTERM, removes its own: libfabric's shm
provider unlinks an endpoint's region when the endpoint closes (prov/shm/src/smr_util.c,
smr_free), and the MoE chapters unlink their files once mapped. One that was SIGKILLed
removes nothing, so the launchers (common/launch, scripts/pair.py), the tests and the
peer that outlives it (remove_dead_peers: a client its server's, a server its client's)
remove what it left, knowing the names:

- the shm provider names each endpoint's region "<pid>:<uid>:<n>" after the process that
  created it (prov/shm/src/smr_ep.c, smr_endpoint_name);
- a job's own files carry its name (common/moe/memory.py: "moe-<job>-<what>");
- an endpoint's address is its region's name after "fi_shm://" (smr_endpoint_name), so a
  peer knows whose regions to look for.

What a process killed before any peer saw it leaves, nobody knows to remove: the next
chapter to run sweeps it (sweep()). Libfabric 1.17, 2.1 and 2.6 name regions alike.

Standard library only: pair.py and the tests use it without loading libfabric.
"""
import os
import re
import stat
import time
from pathlib import Path

SHM = Path("/dev/shm")
REGION = re.compile(r"^(\d+):(\d+):\d+")
JOB_FILE = re.compile(r"^moe-[0-9a-f]+-")
SWEEP_AGE = 10.0  # seconds a file must have been left alone before sweep() judges it
PID_NS_INIT = 0xEFFFFFFC  # the initial pid namespace's inode (linux/proc_ns.h, PROC_PID_INIT_INO)
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


def sweep(age=SWEEP_AGE):
    """Remove what processes of ours left in /dev/shm and nobody uses: a shm region of our
    uid whose pid has ended, or a job's file ("moe-<job>-"), ours, unchanged for `age` s
    and mapped by no process. Returns the names removed.

    Only in the initial pid namespace, where every process of the machine, whatever its
    namespace, is in /proc: "mapped by no process" is then a fact, and it is what tells a
    file in use, since an endpoint maps its region from smr_create to fi_close
    (prov/shm/src/smr_util.c) and a job's file is mapped by its maker from the start
    (common/moe/memory.py); a region whose pid lives here is kept too. In a container,
    /dev/shm may be shared with processes we cannot see and whose pids mean nothing here
    (docker --ipc=host, a Kubernetes pod's containers): nothing is swept (a container's
    own /dev/shm goes with it). Processes whose maps we may not read are not peers of
    ours: another user's cannot open our files (mode 0600, smr_create's shm_open), and
    ours are readable unless made undumpable (a setuid program, a sandbox's init).
    The age covers a file made but not yet mapped, and a region taken over by a process
    given the dead one's pid (smr_retry_map: smr_create's ftruncate then stamps it),
    which is looked at again just before the unlink."""
    if not SHM.is_dir() or not initial_pid_namespace():
        return []
    uid, now, found = os.geteuid(), time.time(), {}
    for entry in os.scandir(SHM):
        match = REGION.match(entry.name)
        if not (match and int(match[2]) == os.getuid() or JOB_FILE.match(entry.name)):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        if (stat.S_ISREG(st.st_mode) and st.st_uid == uid and now - st.st_mtime >= age
                and not alive(entry.name)):
            found[st.st_dev, st.st_ino] = (entry.name, st.st_mtime)
    used = mapped() if found else set()
    removed = []
    for key, (name, mtime) in found.items():
        if key in used:
            continue
        try:
            st = (SHM / name).stat()
            if (st.st_dev, st.st_ino, st.st_mtime) == (*key, mtime) and not alive(name):
                (SHM / name).unlink()
                removed.append(name)
        except FileNotFoundError:  # removed meanwhile by whoever else cleans up
            pass
    return sorted(removed)


def alive(name):
    """Whether the process that a region's name carries still runs here (False for a file
    whose name carries no pid)."""
    pid = creator(name)
    return pid is not None and not ended(pid)


def initial_pid_namespace():
    try:
        return os.stat("/proc/self/ns/pid").st_ino == PID_NS_INIT
    except OSError:
        return False


def mapped():
    """(device, inode) of every file that a process we may read maps."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/maps") as f:
                text = f.read()
        except OSError:  # ended meanwhile, or not ours to read (see sweep)
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)  # address perms offset device inode path
            if len(fields) >= 5 and fields[4] != "0":
                major, minor = fields[3].split(":")
                found.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
    return found

"""A chapter that starts removes what killed processes left in /dev/shm, and only that
(common/shm_files.py, sweep): never a region whose process lives, nor one a live process
maps, nor a file just made, nor anything where other pid namespaces may share /dev/shm."""
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

from common import shm_files
from common.chapter_pair import chapter_path, local_env
from tests.support.budget import Budget

SHM = shm_files.SHM
# Maps the file named by argv[1], says so, and keeps it mapped until its stdin closes.
MAPS = ("import mmap, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); m = mmap.mmap(fd, 4096); "
        "print('mapped', flush=True); sys.stdin.read()")
# Opens an shm endpoint and waits to be killed.
ENDPOINT = ("import common.fabric as fi, time; info, _ = fi.pick('shm'); own = fi.Closer(); "
            "fi.open_endpoint(own, info); print('open', flush=True); time.sleep(600)")
HOUR = 3600


def ended_pid():
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def left(name, age=HOUR):
    """A file in /dev/shm of a page, last changed `age` s ago."""
    path = SHM / name
    path.write_bytes(bytes(4096))
    past = time.time() - age
    os.utime(path, (past, past))
    return name


def test_only_what_no_one_uses_is_swept():
    dead, uid, job = ended_pid(), os.getuid(), uuid.uuid4().hex[:12]
    names = {"dead": left(f"{dead}:{uid}:7001"), "job": left(f"moe-{job}-0-data"),
             "live": left(f"{os.getpid()}:{uid}:7002"), "used": left(f"{dead}:{uid}:7003"),
             "fresh": left(f"{dead}:{uid}:7004", age=0)}
    user = subprocess.Popen([sys.executable, "-c", MAPS, str(SHM / names["used"])],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert user.stdout.readline() == "mapped\n"
        removed = shm_files.sweep()
        # gone, by this sweep or by that of a chapter another job started meanwhile
        assert not any((SHM / names[k]).exists() for k in ("dead", "job")), removed
        kept = {names[k] for k in ("live", "used", "fresh")}
        assert not kept & set(removed) and all((SHM / n).exists() for n in kept)
    finally:
        user.stdin.close()
        user.wait()
        for name in names.values():
            (SHM / name).unlink(missing_ok=True)


def test_nothing_is_swept_in_another_pid_namespace():
    """Its pids are not those in the regions' names, and /dev/shm may be shared beyond it."""
    budget, unshare = Budget(30), ["unshare", "--pid", "--fork", "--mount-proc"]
    if not shutil.which("unshare") or budget.run([*unshare, "true"]).returncode != 0:
        pytest.skip("no pid namespace of our own here (unshare needs privileges)")
    name = left(f"{ended_pid()}:{os.getuid()}:7005")
    try:
        done = budget.run([*unshare, sys.executable, "-c",
                           "from common import shm_files; print(shm_files.sweep())"])
        assert done.stdout == "[]\n" and (SHM / name).exists(), done.stdout + done.stderr
    finally:
        (SHM / name).unlink(missing_ok=True)


def test_a_chapter_removes_the_region_of_a_process_killed_before_a_peer_saw_it():
    budget = Budget(60)
    proc = subprocess.Popen([sys.executable, "-c", ENDPOINT], stdout=subprocess.PIPE,
                            text=True, env=local_env())
    try:
        assert proc.stdout.readline() == "open\n"
        region, = shm_files.regions(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    try:
        past = time.time() - HOUR
        os.utime(SHM / region, (past, past))
        done = budget.run([sys.executable, str(chapter_path(3)), "-p", "shm"], env=local_env())
        assert done.returncode == 0, done.stderr
        said = [line for line in done.stdout.splitlines() if line.startswith("removed from")]
        assert said and region in said[0].split(), done.stdout
        assert not (SHM / region).exists()
    finally:
        shm_files.remove_left_by([proc.pid])

"""A server whose own shm region lock a client left held (killed or stopped mid-post) on
libfabric < 1.18 serves its next client (common/fabric/poller.py, OwnLock): its wait for
that client never reads a CQ whose progress would spin on the lock. Was: deaf (the lock
held, nothing signalled) or spinning in fi_cq_read forever, and the next client timed out.
tests/programs/lock_holder.py leaves that state at once; kills of real clients find it about once
in 120."""
import signal
import subprocess
import sys

import pytest

from common import shm_files
import common.fabric as fi
from common.chapter_pair import ADDRESS, chapter_path, local_env
from tests.support.budget import Budget
from tests.support.chapter_procs import SMALL, server_line, start

pytestmark = pytest.mark.skipif(fi.version() >= (1, 18), reason="from 1.18 shm's queue "
                                "takes commands without the region lock")
HOLDER = chapter_path(4).parents[1] / "tests" / "programs" / "lock_holder.py"
CLIENT = {5: [], 6: [], 7: [*SMALL, "--iters", "200", "--delivery-complete"],
          9: ["--iters", "200", "--page-size", "64K", "--buffer-size", "1M"]}
RENEWED = "opening the endpoint again at the same address"


def hold_lock(address, how):
    """A process that takes the lock of the server at `address` and is then killed
    (SIGKILL) or stopped (SIGSTOP), by itself, holding it."""
    holder = subprocess.Popen([sys.executable, str(HOLDER), address, *how], text=True,
                              stdout=subprocess.PIPE)
    assert holder.stdout.readline() == "holding\n"
    return holder


def locked_then_served(chapter, how=(), clients=1):
    """A server of `chapter` on shm, its lock held by a dead (or stopped) process, then an
    honest client: (the client, the server's exit code, its stderr)."""
    budget = Budget(90)
    server, out = start(chapter, ["-p", "shm", "--clients", str(clients)], ADDRESS.pattern)
    holder = None
    try:
        address = ADDRESS.search(out)[1]
        holder = hold_lock(address, how)
        said = server_line(server, budget)
        client = budget.run([sys.executable, str(chapter_path(chapter)), "-p", "shm", address,
                             "--timeout", f"{budget.grant(10):g}", *CLIENT.get(chapter, [])],
                            env=local_env())
        _, err = budget.communicate(server)
    finally:
        for proc in (server, holder):
            if proc is not None:
                proc.kill()
                proc.wait()
                shm_files.remove_left_by([proc.pid])
    return client, server.returncode, said + err


def test_06_a_client_killed_holding_the_servers_lock_leaves_it_serving():
    client, rc, err = locked_then_served(6)
    assert err.splitlines()[0].endswith(RENEWED), err
    assert len(err.splitlines()) == 1 and rc == 0, err
    assert client.returncode == 0, client.stderr


@pytest.mark.long
@pytest.mark.parametrize("chapter,how", [(5, ()), (6, ("stop",)), (7, ()), (9, ())])
def test_every_idle_server_outlives_a_dead_or_stopped_lock_holder(chapter, how):
    """05, 07 and the engine of 09-15 (common/engine/multinet.py) as 06; a holder stopped
    (SIGSTOP), which might be continued, as one killed."""
    client, rc, err = locked_then_served(chapter, how)
    assert err.splitlines()[0].endswith(RENEWED), err
    assert "Traceback" not in err and rc == 0, err
    assert client.returncode == 0, client.stderr


@pytest.mark.long
def test_04_a_server_of_one_message_ends_in_one_line():
    """Chapter 04's server reads one message and ends: held lock, it says so and exits 1."""
    budget = Budget(60)
    server, out = start(4, ["-p", "shm"], ADDRESS.pattern)
    try:
        hold_lock(ADDRESS.search(out)[1], ()).wait()
        _, err = budget.communicate(server)
    finally:
        server.kill()
        server.wait()
    assert server.returncode == 1, err
    assert len(err.splitlines()) == 1 and "locked for" in err, err
    assert not shm_files.remove_left_by([server.pid])

"""A test that Ctrl-C cuts (tests/test_project_pytest_ctrl_c.py runs it, alone): it starts a
chapter's server that would wait a minute for its client, says the server's pid, and waits
for it."""
from common.chapter_pair import ADDRESS
from tests.support import chapter_procs
from tests.support.budget import Budget


def test_a_server_waits_for_a_client():
    server, _ = chapter_procs.start(4, ["-p", "shm", "--timeout", "60"], ADDRESS.pattern)
    print(f"server pid {server.pid}", flush=True)
    Budget(120).communicate(server)

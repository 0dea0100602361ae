"""What conftest.py finds still running after a test: only processes with the suite's token,
stopped even when they ignore SIGTERM, never anyone else's."""
import os
import subprocess
import sys
import uuid

from tests.support import processes

IGNORES_TERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(60)")


def test_a_process_with_the_token_is_named_and_stopped_and_no_other():
    token = f"FABRIC3200_TEST_PROCESSES={uuid.uuid4().hex}"
    name, value = token.split("=")
    env = {k: v for k, v in os.environ.items() if k != name}
    ours, theirs = (subprocess.Popen([sys.executable, "-c", IGNORES_TERM], env=e, text=True,
                                     stdout=subprocess.PIPE)
                    for e in (dict(env, **{name: value}), env))
    try:
        assert ours.stdout.readline() == theirs.stdout.readline() == "ready\n"
        left = processes.wait_gone(token.encode(), 0.5)
        assert list(left) == [ours.pid] and IGNORES_TERM in left[ours.pid]
        processes.stop(token.encode(), left, seconds=0.5)
        assert ours.wait(5) == -9  # SIGTERM ignored, then killed
        assert theirs.poll() is None
        assert processes.running(token.encode()) == {}
    finally:
        for proc in (ours, theirs):
            proc.kill()
            proc.communicate()

"""A process whose provider call never returns, for tests/test_bounds.py.

The call is faked: libc's pthread_mutex_lock on a mutex this thread holds already, which
neither returns nor lets Python run a signal handler, like shm's spin on a region lock
that a dead peer held (and without taking a core of the busy test machine).

    stuck.py wait TIMEOUT   a Poller's wait for a heartbeat, `TIMEOUT` s, whose fi_cq_read hangs
    stuck.py idle           the same with no timeout (a server waiting for a client): a signal
    stuck.py close          a Closer whose fi_close hangs
    stuck.py join           a transfer engine whose worker thread hangs, closed
"""
import ctypes
import sys
import threading

import common.fabric as fi
from common.fabric import poller
from common import cli

LIBC = ctypes.CDLL(None)


def hang(*_):
    """Say "waiting", then block for good, the GIL released, deaf to signals."""
    mutex = ctypes.create_string_buffer(64)  # zeroes: PTHREAD_MUTEX_INITIALIZER in glibc
    LIBC.pthread_mutex_lock(mutex)
    print("waiting", flush=True)
    LIBC.pthread_mutex_lock(mutex)


def wait(timeout):
    poller.cq_read = hang  # what Poller.poll calls
    fi.Poller(None).wait([fi.ffi.new("struct fi_context2 *")], timeout,
                         "heartbeat from the server")


def join():
    from common.transfer import Engine
    with fi.Closer() as own:
        eng = Engine(own, provider="shm", timeout=5)
        eng._w.stop = 1  # the real worker stops; in its place, one that never will
        eng._thread.join()
        eng._thread = threading.Thread(target=hang, daemon=True, name="the worker thread")
        eng._thread.start()


def close():
    with fi.Closer() as own:
        own.callback(hang)


def main():
    mode = sys.argv[1]
    if mode in ("close", "join"):
        return close() if mode == "close" else join()
    return wait(float(sys.argv[2]) if mode == "wait" else None)


if __name__ == "__main__":
    cli.run(main)

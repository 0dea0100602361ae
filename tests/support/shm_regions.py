"""Which /dev/shm regions our own test processes made, so that only those count as leaks.

libfabric's shm provider names each endpoint's region after the process that created it
(common/shm_files.py knows the names). Other programs on the
machine (a reader's benchmark, a chapter server left running) make regions of their own
while the suite runs; those are not ours to judge.

Ours are the processes that inherit a token the suite puts in its environment. A thread
blocked on inotify sees each region appear while its creator is still opening it, and
reads the creator's environment then. A region whose creator was gone before it could be
read is counted as ours: a leak is never hidden, at the price of blaming the suite for a
foreign process that made a region and died within that instant.

A chapter that starts sweeps regions of ended processes that nobody maps once they are
10 s old (common/shm_files.py, sweep): a leak is looked for here right after each test,
and only one older than that, of a test that starts a chapter after it, is gone first.
"""
import ctypes
import os
import select
import struct
import threading
import uuid
from pathlib import Path

from common.shm_files import SHM, creator, ended, regions as files

IN_CREATE, IN_MOVED_TO = 0x100, 0x80
EVENT = struct.Struct("iIII")  # struct inotify_event without its name


class Watcher:
    """Tells the regions of processes that inherit `variable` (set here, in this process's
    environment, to a value of its own) from everyone else's."""

    def __init__(self, variable="FABRIC3200_TEST_RUN"):
        value = uuid.uuid4().hex
        os.environ[variable] = value
        self.token = f"{variable}={value}".encode()
        self.seen = set()     # names of the regions whose creator was looked at
        self.foreign = set()  # those whose creator was seen without the token
        self.before = files()
        libc = ctypes.CDLL(None, use_errno=True)
        self.thread, fd = None, libc.inotify_init1(os.O_CLOEXEC)
        if fd >= 0 and libc.inotify_add_watch(fd, bytes(SHM), IN_CREATE | IN_MOVED_TO) >= 0:
            # Its own pipe stops the thread: closing the inotify fd under a blocked read would
            # let the read take bytes from whatever file reuses the number (a chapter's stdout)
            self.fd, (self.stop, self.stopping) = fd, os.pipe()
            self.thread = threading.Thread(target=self._watch, daemon=True)
            self.thread.start()
        elif fd >= 0:  # no inotify on /dev/shm (some sandboxes): only creators still alive
            os.close(fd)  # are told apart

    def ours(self, pid):
        try:
            return self.token in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone already, or not ours to read: judged at the end
            return None

    def _watch(self):
        while True:
            ready, _, _ = select.select([self.fd, self.stop], [], [])
            if self.fd in ready:
                self._read(os.read(self.fd, 64 * 1024))
            if self.stop in ready:
                return

    def _read(self, data):
        at = 0
        while at < len(data):
            _, _, _, size = EVENT.unpack_from(data, at)
            name = data[at + EVENT.size:at + EVENT.size + size].rstrip(b"\0")
            at += EVENT.size + size
            pid = creator(name.decode(errors="replace"))
            if pid is not None and self.ours(pid) is False:
                self.foreign.add(name.decode())
            if pid is not None:
                self.seen.add(name.decode())

    def orphans(self):
        """Regions of ours whose creator has ended, removed: after a test, once its processes
        are gone, what they left. Caught here, a test's leak is named with it; left until the
        pids come round again, it made a later process with the same pid fail (fi_enable:
        EBUSY, see common/fabric) and was removed by that failure, without a trace."""
        names = {name for name in self._made() if ended(creator(name))}
        for name in names:
            (SHM / name).unlink(missing_ok=True)
        return names

    def left(self):
        """Regions made since the start by our processes (or by creators gone unseen)."""
        if self.thread is not None:
            os.write(self.stopping, b".")
            self.thread.join()
            for fd in (self.fd, self.stop, self.stopping):
                os.close(fd)
            self.thread = None
        return self._made()

    def _made(self):
        """Regions there now, made since the start by our processes (or by creators gone
        unseen)."""
        return {name for name in files() - self.before - self.foreign
                if self.ours(creator(name)) is not False}

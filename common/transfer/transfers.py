"""The transfer engine's commands in flight: a Transfer (the C worker's WRITEs) or an
IpcTransfer (one kernel on the CUDA IPC route), waited for with the engine's wait, and
TransferError, what a WRITE that failed raises."""
import time

import common.fabric as fi
from common.transfer._native import ffi as _ffi, lib as native

PHASES = ("building", "picking up", "posting", "completing", "seeing")  # Transfer.phases


class TransferError(fi.FabricError):
    """A WRITE failed; the text is the provider's (fi_cq_strerror) or the call's. A
    FabricError, so that a chapter says it in one line (cli.run): tcp fails the WRITEs in
    flight to a peer that died."""

    def __init__(self, text, rc=0):
        RuntimeError.__init__(self, text)  # the whole text: no call of ours to name first
        self.call, self.rc, self.text = "a WRITE", rc, text


class Transfer:
    """One command's WRITEs: done when every one completed; wait() raises on failure."""

    def __init__(self, engine, command, keep):
        self.engine, self.command, self._keep = engine, command, keep
        self.count = command.count

    @property
    def done(self):
        return native.tx_done(self.command) >= self.count

    def wait(self, timeout=None):
        """Wait until every WRITE completed; TransferError (the provider's text) if one
        failed, TimeoutError after `timeout` s (default: the engine's)."""
        timeout = self.engine.timeout if timeout is None else timeout
        self.engine._until(lambda: self.done, timeout, lambda: (
            f"{self.count} WRITEs not completed within {timeout:g} s "
            f"({native.tx_done(self.command)} completed, {self.command.posted} posted)"))
        self.raise_failure()
        return self

    def phases(self, called, returned):
        """Where a finished command's time went, in seconds: from the call that made it
        (`called`, time.monotonic_ns()) to its queuing (Python building it), the worker's
        first post, its last post, the last completion, and `returned` (time.monotonic_ns()
        once wait() returned: Python seeing it). The worker's stamps are CLOCK_MONOTONIC's,
        time.monotonic's clock."""
        marks = [called, *(int(t) for t in self.command.ns), returned]
        return {name: (b - a) * 1e-9 for name, a, b in zip(PHASES, marks, marks[1:])}

    def raise_failure(self):
        c = self.command
        if native.tx_status(c):
            raise TransferError(f"WRITE on NIC {c.failed_nic} failed: "
                                f"{_ffi.string(c.error).decode(errors='replace')} "
                                f"(ret {c.status}; {c.skipped} of {c.count} not posted)",
                                c.status)


class IpcTransfer:
    """One command sent by CUDA IPC (ipc.py): done once its kernel stored its sequence
    number into the peer's inbox; nothing can fail after the launch but the GPU itself."""

    def __init__(self, engine, record, seq, count, queued, launched):
        self.engine, self.record, self.seq = engine, record, seq
        self.count, self.ns = count, (queued, launched, 0)  # ns: queued, launched, seen

    @property
    def done(self):
        if self.ns[2]:
            return True
        if self.record.seq < self.seq:  # a later lap of the ring stores a larger one
            return False
        self.ns = (*self.ns[:2], time.monotonic_ns())
        return True

    def wait(self, timeout=None):
        timeout = self.engine.timeout if timeout is None else timeout
        self.engine._until(lambda: self.done, timeout, lambda: (
            f"a command of {self.count} copies by CUDA IPC not done within {timeout:g} s"))
        return self

    def phases(self, called, returned):
        """As Transfer.phases: building (Python), posting (the launch), completing (the
        kernel, until Python saw its mark), seeing; no worker picks it up."""
        queued, launched, seen = self.ns
        marks = [called, queued, queued, launched, seen or returned, returned]
        return {name: (b - a) * 1e-9 for name, a, b in zip(PHASES, marks, marks[1:])}

    def raise_failure(self):
        pass


class _Several:
    """Transfers that are done together (a scatter's, one per member)."""

    def __init__(self, transfers):
        self.transfers = transfers
        self.count = sum(t.count for t in transfers)

    @property
    def done(self):
        return all(t.done for t in self.transfers)

    def wait(self, timeout=None):
        for t in self.transfers:
            t.wait(timeout)
        return self

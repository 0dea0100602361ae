"""A Ctrl-C that lands in the middle of closing still closes everything: each object is
its own step of the Closer, so one step cut short skips none of the others."""
import numpy as np
import pytest

import common.fabric as fi
from tests.support.budget import Budget

transfer = pytest.importorskip("common.transfer")  # skipped only if the worker is not built


def test_engine_interrupted_while_its_worker_stops(monkeypatch):
    """Chapter 19's rank once said 'fi_close: Device or resource busy': a second signal cut
    into the join of the engine's worker, which skipped the regions' registrations, and
    the domain was closed with them still open."""
    with pytest.raises(KeyboardInterrupt):
        with fi.Closer() as own:
            eng = transfer.Engine(own, provider="shm", timeout=Budget(10).seconds)
            eng.register(np.zeros(4096, np.uint8))
            join = eng._thread.join

            def interrupted_join(timeout=None):  # as common/bounds.join calls it
                join(timeout)  # the worker is gone (nothing is closed under it), then the signal
                raise KeyboardInterrupt
            monkeypatch.setattr(eng._thread, "join", interrupted_join)

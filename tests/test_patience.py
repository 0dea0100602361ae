"""Waits for a peer stretch with the machine's load, within bounds."""
import os

from common import patience


def test_a_busy_machine_waits_longer_a_quiet_one_as_told(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.0, 0.0))
    assert patience.patience(10) == 10
    monkeypatch.setattr(os, "getloadavg", lambda: (7.0, 0.0, 0.0))
    assert patience.patience(10) == 35
    monkeypatch.setattr(os, "getloadavg", lambda: (500.0, 0.0, 0.0))
    assert patience.patience(10) == 10 * patience.MOST


def test_no_load_average_means_a_quiet_machine(monkeypatch):
    def unavailable():
        raise OSError("no load average")
    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert patience.patience(10) == 10

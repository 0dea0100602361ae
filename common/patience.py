"""How long to wait for a peer on a machine as busy as this one.

A peer with a core to itself answers within milliseconds. On a machine with more
runnable threads than cores (a 2-core laptop running the test suite beside a benchmark
and a forgotten server) each thread gets a share of a core, and a wait measured on the
wall clock has to stretch by that share, or a slow peer is taken for a dead one.
For the scripts and tests that start chapters and wait for them (standard library
only). A chapter's own --timeout is what its user gave, or 10 s, so that a dead peer is
said when promised (common/bounds.py); the test suite asks for its default stretched
(STRETCH, read by common/cli.py and common/bounds.py).
"""
import os

MOST = 10.0  # a peer that is gone is still seen within 10x the quiet-machine wait
# Set (to anything) by a test suite, whose machine is busy by design: a chapter's default
# --timeout and the time it gives closing (bounds.close_bound) then stretch with the load.
# A person gets the bounds they read.
STRETCH = "FABRIC3200_STRETCH_TIMEOUT"


def load():
    """Runnable threads per core over the last minute (os.getloadavg), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
        return min(MOST, max(1.0, os.getloadavg()[0] / cores))
    except (AttributeError, OSError):  # no load average on this system: assume a quiet one
        return 1.0


def patience(seconds):
    """`seconds` on a quiet machine, stretched by the load on this one."""
    return seconds * load()


def stretched(seconds):
    """`seconds`, stretched by the load only where a test suite asked for it (STRETCH)."""
    return patience(seconds) if os.environ.get(STRETCH) else seconds

"""One test's time: the load read once, at its start, and every wait it hands out cut from it.

patience() reads the load each time it is called. A limit computed at import and a grace
computed when the test ran came out in the wrong order once (the load rose in between: a
launcher killed at its 180 s limit had been granted 238 s of grace, and its ranks were left
running). A Budget stretches every figure of one test by the same load, and grants only
waits shorter than itself, so an inner wait always ends before the outer one.
Tests take their waits from a Budget, never from patience() (tests/test_support_budget.py checks).
"""
import signal
import subprocess
import time

from common.patience import load

STOP = 10.0  # seconds, quiet machine, a launcher gets to stop its ranks after Ctrl-C


class Budget:
    def __init__(self, seconds):
        self.quiet, self.load = seconds, load()
        self.seconds = seconds * self.load
        self.deadline = time.monotonic() + self.seconds

    def grant(self, seconds):
        """`seconds` (quiet machine) stretched by this test's load: a wait inside the test,
        which must be shorter than the whole of it."""
        if not 0 < seconds < self.quiet:
            raise ValueError(f"a wait of {seconds:g} s does not fit in a test of "
                             f"{self.quiet:g} s")
        return seconds * self.load

    def left(self):
        """Seconds to the end of the test: what its last wait may take."""
        return max(0.0, self.deadline - time.monotonic())

    def communicate(self, proc):
        """`proc.communicate()` within what is left; a process still running then gets
        Ctrl-C, so that a launcher stops its ranks and a chapter closes what it opened,
        and is killed if it ignores that."""
        try:
            return proc.communicate(timeout=self.left())
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.communicate(timeout=STOP * self.load)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise

    def run(self, args, **popen):
        """subprocess.run(args, capture_output=True, text=True, timeout=self.left()), but a
        process still running at the end is stopped as communicate() stops it."""
        with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              **popen) as proc:
            out, err = self.communicate(proc)
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

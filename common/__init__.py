"""What the chapters share once a chapter has taught it."""
import os
import signal
import sys


def _importing(signum, frame):  # until bounds.quiet_start below: nothing is open yet
    try:
        os.write(2, f"{os.path.basename(sys.argv[0])}: interrupted before it started\n".encode())
    except OSError:  # no one reads stderr any more (a launcher killed with -9): exit all the same
        pass
    os._exit(128 + signum)


# Python's defaults, as the program found them: while bounds itself imports, a signal is
# this module's to take; then quiet_start decides (it keeps any handler a program set)
_found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
try:
    for _s in _found:
        if _found[_s] in (signal.default_int_handler, signal.SIG_DFL):
            signal.signal(_s, _importing)
except ValueError:  # imported first in a thread other than the main one: not ours to set
    pass

from common import bounds  # noqa: E402

bounds.quiet_start(_found)  # a Ctrl-C while a program still imports: its exit code, one line

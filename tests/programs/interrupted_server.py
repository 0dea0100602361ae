"""A chapter run as it is, but with Ctrl-C (KeyboardInterrupt) raised just after the Nth
successful return of one libfabric call: where a real Ctrl-C mostly lands, since the call
is where the time goes, and before the caller has noted what the call did.

    .venv/bin/python tests/programs/interrupted_server.py fi_writemsg 2000 [--failing-close] CHAPTER.py ARGS...

fi_writemsg counts the posts of the op queue (common/engine/opqueue.py), fi_cq_read the
reads that returned completions. --failing-close: the first fi_close after the interrupt
closes, then raises FabricError, as a clean-up step that fails would.
"""
import errno
import runpy
import sys

import common.engine.opqueue as opqueue
import common.fabric as fi
from common.fabric import calls


class Interrupting:
    """Stands for the cffi lib: every name is the real one, but `call`, which raises
    KeyboardInterrupt after its `after`th successful return (the call did its work)."""

    def __init__(self, lib, call, after):
        self.lib, self.call, self.left, self.fired = lib, call, after, False

    def __getattr__(self, name):
        real = getattr(self.lib, name)
        if name != self.call:
            return real

        def interrupted_after(*args):
            rc = real(*args)
            if (rc > 0 if name == "fi_cq_read" else rc == 0) and not self.fired:
                self.left -= 1
                if not self.left:
                    self.fired = True
                    raise KeyboardInterrupt
            return rc
        return interrupted_after


def failing_close(lib, close):
    """fi.close, but the first close after the interrupt fails once it has closed."""
    def close_then_fail(obj):
        close(obj)
        if lib.fired and not close_then_fail.failed:
            close_then_fail.failed = True
            raise fi.FabricError("fi_close", -errno.EBUSY)
    close_then_fail.failed = False
    return close_then_fail


def main():
    call, after, *rest = sys.argv[1:]
    fake = Interrupting(fi.lib, call, int(after))
    if rest[0] == "--failing-close":
        fi.close = calls.close = failing_close(fake, fi.close)  # Closer calls calls.close
        rest = rest[1:]
    fi.lib = calls.lib = opqueue.lib = fake  # the modules that make these calls
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()

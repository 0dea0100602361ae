"""The binding loaded (common._fabric: ffi, lib), with SIGINT and SIGTERM held off while
libfabric loads its providers and ours put back after; Ctrl-C as KeyboardInterrupt until
the process says its last words (stop_interrupting); which libfabric was loaded."""
import os
import re
import signal
import sys
import threading

from common import bounds, shm_files

# Loading libfabric loads its providers, and Debian's PSM (libinfinipath) installs handlers
# for SIGINT, SIGTERM and the crash signals that print a backtrace: a Ctrl-C then ended the
# process with 1, skipping everything. Asked not to (its IPATH_NO_BACKTRACE); and, for
# other providers' handlers, ours are put back once it has loaded (_take_back_signals)
# while the signals are held off this thread. Held off this thread only: a thread numpy
# had started (OpenBLAS's) still took a SIGTERM in that window, to libinfinipath's
# handler, and the process ran on as if none had come (8 of 40 SIGTERMs sent to a rank
# of 19 as it started; a launcher killed then left its ranks running).
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")
_held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
try:
    from common._fabric import ffi, lib
except ImportError as e:  # not built, or libfabric.so gone since
    sys.exit(f"libfabric binding unavailable ({e}): run 'bash scripts/setup.sh'")

# The shm provider names an endpoint's region after this process's pid and refuses
# (fi_enable: EBUSY) to reuse a region of that name whose recorded creator is alive
# (prov/shm/src/smr_util.c, smr_retry_map): this very process, when one that had this pid
# before, SIGKILLed, left its region and the pids came round (after 32768 by Linux's default
# pid_max; one run of our tests takes some 9,400). No endpoint of ours exists yet, so a region
# carrying our pid is such a leftover.
shm_files.remove_left_by([os.getpid()])

# The API version our headers describe; libfabric 2.x still serves 1.x callers.
API_VERSION = (lib.FI_MAJOR_VERSION << 16) | lib.FI_MINOR_VERSION
LIBFABRIC = re.compile(r"libfabric(-[0-9a-f]+)?\.so(\.\d+)*")  # also a wheel's (auditwheel)


def libfabrics(maps):
    """The libfabric.so files mapped, per `maps` (the text of /proc/PID/maps), each once;
    also those a wheel bundles renamed (auditwheel: libfabric-<hash>.so.1)."""
    found = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        path = fields[5] if len(fields) == 6 else ""
        if LIBFABRIC.fullmatch(os.path.basename(path)) and path not in found:
            found.append(path)
    return found


def loaded_from():
    """The path of the libfabric.so this process has loaded, or None."""
    try:
        with open("/proc/self/maps") as maps:
            return next(iter(libfabrics(maps.read())), None)
    except OSError:
        return None


def loads_from(prefix):
    """Whether the libfabric this binding loaded lies under `prefix` (an install prefix)."""
    path = loaded_from()
    return path is not None and os.path.realpath(path).startswith(
        os.path.realpath(prefix) + os.sep)


def prefix_mismatch():
    """LIBFABRIC_PREFIX picks a libfabric when the binding is built (scripts/setup.sh); set
    for a program, it must name the one the binding loads: else a reader on a p5 could
    believe the EFA installer's in use while another runs. None, or one line saying which
    is loaded and how to rebuild. Unset or empty (setup.sh's "the system's"): None."""
    prefix = os.environ.get("LIBFABRIC_PREFIX")
    if not prefix or loads_from(prefix):
        return None
    return (f"LIBFABRIC_PREFIX={prefix}, but the binding loads "
            f"{os.path.realpath(loaded_from() or '?')} (libfabric {'%d.%d' % version()}): to "
            f"use that one, rebuild the binding: LIBFABRIC_PREFIX={prefix} bash "
            "scripts/setup.sh; or unset it")


def version():
    """The version of the libfabric library loaded at run time, as (major, minor)."""
    v = lib.fi_version()
    return v >> 16, v & 0xFFFF


_interrupting = True  # False once the process is saying its last words (cli.run)


def _interrupted(signum, frame):
    if bounds.forked():  # a child not yet exec'd: its parent stops it (bounds.forked)
        return
    bounds.noted(signum)  # which one: the exit code says it (bounds.exit_code)
    if not bounds.watching() and bounds.importing(frame):  # a program before its main(): nothing
        bounds.end("interrupted before it started", bounds.exit_code())  # is open to close
    if _interrupting:
        raise KeyboardInterrupt


def stop_interrupting():
    """From now on Ctrl-C and SIGTERM interrupt nothing, one already on its way included:
    the process is reporting and exiting."""
    global _interrupting
    _interrupting = False


def _take_back_signals():
    """Undo what provider libraries did to SIGINT/SIGTERM while libfabric loaded them.

    Debian's libfabric loads PSM (libinfinipath), whose handlers call exit(1):
    Ctrl-C would skip our clean-up. shm's handler, installed later, removes
    its /dev/shm files and then chains to whatever was there before: ours.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupted)
        signal.signal(signal.SIGTERM, _interrupted)


_take_back_signals()  # loading the binding is enough for PSM's handlers to be installed
for _early in signal.sigpending() & {signal.SIGINT, signal.SIGTERM}:  # came while it loaded:
    bounds.noted(_early)                                          # nothing is open to close
    bounds.end("interrupted while libfabric loaded", bounds.exit_code())
signal.pthread_sigmask(signal.SIG_SETMASK, _held)

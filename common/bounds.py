"""How soon every process ends, and the watchdog that holds it to that even when a provider
call never returns.

The bounds, the same for a server, a client and a rank:

- SIGINT (Ctrl-C) or SIGTERM: the process ends within STOP_BOUND (2 s) of the first one,
  exit 130 or 143, one line on stderr. The main thread turns it into KeyboardInterrupt
  and closes what it opened (common/cli.py); if it has not ended STOP_GRACE after the
  signal (it is inside a provider call that does not return: Python runs signal handlers
  only between bytecodes), the watchdog ends it.
- A dead or frozen peer: every wait for a peer has a deadline, the chapter's --timeout
  from its start (or from the peer's last sign of life), and raises TimeoutError there
  (a gather at the rendezvous first asks it which ranks have not come: 0.5 s at most,
  common/launch.LATE_ANSWER, the rendezvous being no provider call, out of SLACK).
  A survivor then waits for its operations in flight (TIDY_BOUND) and closes what it
  opened (CLOSE_BOUND + SLACK), and ends (a client) or is ready for its next client (a
  server): within --timeout + 5 s. A provider call that never returns is the watchdog's: SLACK
  past the deadline it says which wait that was and ends the process, exit 1. (shm
  spins forever in fi_cq_read or fi_close on the lock of a region whose owner was killed
  holding it: pthread_spin_lock(&smr->lock), prov/shm/src/smr.h.)
- Worker threads, stopped after a failure or a signal, are joined within JOIN_BOUND of
  the time the process runs (a stop, Ctrl-Z, does not count); one that does not stop (it
  spins in the provider) ends the process the same way.
- Before a program's first import of the project (Python's own start, milliseconds) no
  code of ours runs: a signal then ends it Python's way, by the signal or with Python's
  fatal error, or, cutting into its look at argv[0] or a callback of its import system,
  is printed and lost by CPython, which runs the program on (scripts/chaos.py counts
  such a fault apart).
- A child between fork and exec (a subprocess starting) is still in our process group and
  runs our handlers: a terminal's Ctrl-C there is the parent's to act on (forked()).
- Where a server does not outlive its client's fault, in libfabric 1.x: a server that the
  watchdog ended on a dead client's lock (1.17's shm) serves no next client. A post no
  longer waits on a client's lock (common/fabric/peer_lock.h refuses it while held), and
  the server's own progress, which takes its own region's lock (smr_progress_cmd,
  smr_progress_resp: pthread_spin_lock(&ep->region->lock)), held by a client killed or
  stopped in the middle of a post to the server (about 1 client in 120 killed within 10 ms
  of its start), is not entered by a wait for the next client while that lock is held
  (fabric.OwnLock): held for OWN_LOCK_BOUND (1 s), the server says so and opens its endpoint
  again at the same address (04, which serves one message, ends: exit 1). What is left: a
  lock taken in the instant between that look and the provider's, by a client killed
  then: the CQ read is armed, and the watchdog ends the server (exit 1); and a wait with
  a deadline (serving a client) that meets such a lock ends at the watchdog too. On rxm
  (`tcp;ofi_rxm`, 1.x's tcp; `verbs;ofi_rxm`) a frozen client's WRITEs hold tx credits
  of the server's endpoint (one pool an endpoint, tx_attr->size: rxm_get_tx_buf,
  prov/rxm/src/rxm_ep.c) until its process ends, in every version: so chapter 07's
  server, after a failed client there, opens its endpoint again at the same address
  (07_queue.lends_credits) before it serves the next. 2.x's own tcp takes its WRITEs
  from one growing pool (xnet_alloc_xfer, prov/tcp/src/xnet.h; xnet_progress.c creates
  it unbounded), and 2.1's shm ended such a wait at its deadline.

Why these numbers: a clean close takes milliseconds, so 2 s is prompt for a person and
for a launcher stopping its ranks while leaving the clean way room on a busy machine;
SLACK tells a call that never returns from one a loaded machine made late; SLACK, and
TIDY_BOUND + CLOSE_BOUND + SLACK, fit in the 5 s after --timeout. --timeout itself is
what the user asked for or 10 s, not stretched by the machine's load: only a test suite,
whose machine is busy by design, asks chapters to stretch it and CLOSE_BOUND
(patience.STRETCH): there a close starved of CPU by four other jobs is late, not stuck.

The watchdog is a daemon thread (watch(), started by cli.run): it reads the wakeup fd
that Python's C-level signal handler writes to from whatever thread the signal came to,
so it sees the first signal even while the main thread is stuck in a cffi call (which
releases the GIL). Before os._exit it removes this process's shm regions (what
shm's own handler would have done, and a clean close does) and flushes stdout.
Standard library only, and nothing in the hot loops: a wait arms its Deadline once.
"""
import contextlib
import dis
import os
import select
import signal
import sys
import threading
import time

from common import shm_files
from common.patience import stretched

STOP_BOUND = 2.0    # seconds from the first SIGINT/SIGTERM to the end of the process
STOP_GRACE = 1.5    # ... of which the clean way (everything closed) may take this much
SLACK = 3.0         # seconds a wait may overrun its deadline before its call is taken as stuck
CLOSE_BOUND = 1.0   # seconds closing a Closer's objects should take (+ SLACK: the watchdog)
TIDY_BOUND = 1.0    # seconds a survivor may wait for its operations in flight before that
JOIN_BOUND = 1.0    # seconds a stopped worker thread has to return
CLOSING = 0.5       # seconds kept for closing, out of STOP_GRACE, by a wait on the way out
TICK = 0.25         # how often the watchdog looks at the armed deadlines
PAUSED = 1.0        # a look this much later than TICK follows a pause of the process
EXIT_STUCK = 1

_armed = {}         # id -> Deadline, while it is armed
_signalled = []     # the first SIGINT/SIGTERM's (number, time.monotonic()), once one came
_watching = False
_PID = os.getpid()  # this program's: another is a copy forked from it, not yet exec'd


def forked():
    """Whether this is a copy of the program between fork and exec (a child subprocess is
    starting: Python's at-fork hooks, then a preexec_fn run there). A terminal's Ctrl-C that
    reaches it before it leaves our process group is the parent's to act on: the parent
    stops the child it was starting. Acted on here, it printed a traceback from the hooks
    ("Exception ignored in: Random.seed") and was lost."""
    return os.getpid() != _PID


def unwinding(error, kind):
    """Whether `error` is a `kind`, or was raised while one was unwinding the stack (its
    context chain holds one): a clean-up that failed on the way out of an interrupt."""
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__context__
    return False


def noted(signum):
    """Record a SIGINT/SIGTERM (called by the Python-level handler; the watchdog too)."""
    if not _signalled:
        _signalled.append((signum, time.monotonic()))


def signalled():
    """Whether a SIGINT or SIGTERM came: the process is on its way out."""
    return bool(_signalled)


def exit_code(default=130):
    """128 + the number of the first signal seen (130 SIGINT, 143 SIGTERM), else `default`."""
    return 128 + _signalled[0][0] if _signalled else default


class Deadline:
    """A wait that must be over by `at` (time.monotonic()). Armed while its `with` block
    runs: the watchdog ends the process SLACK past it. `what` (a string, or a function
    that says it) names the wait in that last line. A wait moves `at` on when the peer
    gives a sign of life."""
    __slots__ = ("at", "what")

    def __init__(self, timeout, what):
        self.at = time.monotonic() + timeout
        self.what = what

    def __enter__(self):
        _armed[id(self)] = self
        return self

    def __exit__(self, *exc):
        _armed.pop(id(self), None)


def armed(timeout, what):
    """A Deadline for `timeout` seconds, or, for a wait without one (None), a block that
    arms nothing."""
    return Deadline(timeout, what) if timeout is not None else contextlib.nullcontext()


def close_bound():
    """CLOSE_BOUND, stretched by the load where a test suite asked (patience.STRETCH)."""
    return stretched(CLOSE_BOUND)


def tidy(timeout):
    """How long a wait that only tidies up after a failure (operations in flight completing)
    may take: `timeout`, but at most TIDY_BOUND, and once a signal said stop, no more
    than what is left of STOP_GRACE less CLOSING: closing must keep its time within the
    bound."""
    if not _signalled:
        return min(timeout, TIDY_BOUND)
    return max(0.0, min(timeout, _signalled[0][1] + STOP_GRACE - CLOSING - time.monotonic()))


def join(threads, what, bound=JOIN_BOUND):
    """Join `threads` (already told to stop) within `bound` seconds in all. One still
    running is stuck where Python cannot reach it (in a provider call): say so, after the
    error being raised if there is one (why they were stopped), and end the process, as
    nothing else can stop that thread."""
    threads = [t for t in threads if t.ident is not None]  # one not started has nothing to join
    bound = stretched(bound)
    until = looked = time.monotonic()
    until += bound
    for t in threads:
        while t.is_alive() and looked < until:
            t.join(min(TICK, until - looked))
            now = time.monotonic()
            if now - looked > TICK + PAUSED:  # the process was stopped meanwhile: the bound
                until += now - looked         # counts the time it ran
            looked = now
    stuck = [t.name for t in threads if t.is_alive()]
    if stuck:
        raised = sys.exc_info()[1]
        why = f"{raised}; then " if raised and str(raised) else ""
        end(f"error: {why}{what}: {', '.join(stuck)} did not stop within {bound:g} s (stuck "
            "in a provider call): exiting without closing", exit_code(EXIT_STUCK))


def end(line, code):
    """Say `line` (after the program's name) and end the process now, with `code`,
    leaving no shm region of ours behind: for a process whose main thread, or one it must
    wait for, is inside a call that does not return."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    say(f"{os.path.basename(sys.argv[0])}: {line}\n")
    leave(code)


def say(text):
    """Write `text` to stderr, if it is still there: a launcher killed with -9 took the
    pipe with it, and a write's BrokenPipeError, raised out of a signal handler, was taken
    by the code it cut into for its own OSError (a rank retrying its rendezvous ran on)."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


def leave(code):
    """End the process now with `code`, its output flushed, no shm region of ours left
    (what fi_close or shm's own handler would have removed) nor one of a peer that was
    killed, skipping Python's finalization."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    shm_files.remove_left_by([os.getpid()])
    shm_files.remove_dead_peers()
    os._exit(code)


def quiet_start(found):
    """From the project's first import on: a SIGINT or SIGTERM that comes while the program
    is still at its top-level imports (numpy and the binding take seconds on a busy
    machine) ends it with 128 + the signal and one line, not a traceback or a silent death.
    Elsewhere they do what Python's defaults do; the binding's handler (common/fabric)
    replaces these once it is loaded. `found`: the handlers the program had (common/__init__
    took them over while this module imported); one it set itself is given back."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, handler in found.items():  # Python's defaults, or the program's own
        default = handler in (signal.default_int_handler, signal.SIG_DFL)
        signal.signal(signum, _starting if default else handler)


def _starting(signum, frame):
    if forked():
        return
    noted(signum)
    if importing(frame):
        end("interrupted before it started", exit_code())
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)  # SIGTERM's default: the process ends by it
    os.kill(os.getpid(), signum)


def importing(frame):
    """Whether the program is still at one of its top-level imports (before cli.run, where a
    KeyboardInterrupt would end it with a traceback): the outermost frame is a module's
    code, at an import instruction (its line may be the continuation of a long one)."""
    while frame.f_back is not None:
        frame = frame.f_back
    return frame.f_code.co_name == "<module>" and any(
        i.offset == frame.f_lasti and i.opname.startswith("IMPORT")
        for i in dis.get_instructions(frame.f_code))


def watching():
    """Whether watch() runs: the program is in its main() (cli.run)."""
    return _watching


def watch():
    """Start the watchdog (once, from the main thread, after the signal handlers are ours):
    it ends the process STOP_GRACE after the first SIGINT/SIGTERM if it is still running,
    and SLACK past an armed Deadline."""
    global _watching
    if _watching:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)  # the C handler must never block on it
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read,), daemon=True, name="watchdog").start()
    _watching = True


def _watch(fd):
    # A look that comes long after the last one means this process was stopped (SIGSTOP,
    # Ctrl-Z) or starved meanwhile: no call was watched then, and a deadline that passed
    # during the pause is no sign of a stuck call. Its call gets SLACK from the resumption
    # to return, as it would have had running: a server continued after a long stop
    # finds its client gone and serves the next, instead of being ended on waking.
    last = resumed = time.monotonic()
    while True:
        tick = TICK if not _signalled else _signalled[0][1] + STOP_GRACE - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, min(TICK, tick)))
        if ready:
            for signum in os.read(fd, 64):
                if signum in (signal.SIGINT, signal.SIGTERM):
                    noted(signum)
        now = time.monotonic()
        if now - last > TICK + PAUSED:
            resumed = now
        last = now
        if _signalled and now > _signalled[0][1] + STOP_GRACE:
            name = signal.Signals(_signalled[0][0]).name
            end(f"interrupted ({name}), but a call did not return within {STOP_GRACE:g} s: "
                "exiting without closing", exit_code())
        late = next((d for d in list(_armed.values()) if now > max(d.at, resumed) + SLACK),
                    None)
        if late is not None:
            end(f"error: {_said(late)}, and the provider call did not return within "
                f"{SLACK:g} s more: exiting without closing", EXIT_STUCK)


def _said(deadline):
    what = deadline.what
    return what() if callable(what) else what

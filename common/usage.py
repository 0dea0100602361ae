"""Bad command lines in one line, for the scripts that do not load libfabric to parse their
flags (common/cli's parser does: a chapter's flags name providers), and a Ctrl-C in one
line for the scripts whose own process opens nothing (common/cli.run is a chapter's). Also
what common/cli and common/fabric both raise and ask (UsageError, interrupted), here below
both. The standard library only (common/bounds.py is too)."""
import argparse
import os
import re
import signal
import sys

from common import bounds


class UsageError(ValueError):
    """Bad input from the command line, found before any resource is opened."""


class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints its usage and then the error: two lines
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind, what="a positive number"):
    """An argparse type: `kind(text)` above 0, else one line saying it is not `what`."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"not {what}: '{text}'")
        return value
    return parse

def listed(choices, upper=False):
    """An argparse type: a comma-separated list of `choices`, each once, in the order given;
    numbers as two digits ("7" is "07"), or, with `upper`, names in capitals."""
    def parse(text):
        items = [i.strip().upper() if upper else i.strip() for i in text.split(",")]
        items = [f"{int(i):02d}" if i.isdigit() and not upper else i for i in items]
        wrong = [i for i in items if i not in choices]
        if wrong or not items:
            raise argparse.ArgumentTypeError(f"'{text}': choose from {','.join(choices)}")
        return list(dict.fromkeys(items))
    return parse


def parse_size(text):
    """'65536', '64K', '1M', '2G' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: '{text}' (e.g. 4096, 64K, 1M)")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2].upper()]


def run(main):
    """Run the main() of a script whose own process opens nothing it must close (it runs
    chapters or tools as children, and stops those itself): Ctrl-C or SIGTERM ends it with
    one line and exit 130 or 143, not a traceback. No watchdog (common/cli.run has one, for
    a process inside provider calls): it would end the script while it stops a child."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _interrupted)
    try:
        code = main()
    except BrokenPipeError:  # piped into `head`: the reader has what it wanted
        os._exit(0)
    except BaseException as e:  # what a signal cut into may fail its own way on the way out
        if not (isinstance(e, KeyboardInterrupt) or bounds.signalled()):
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # said once, whatever comes next
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: interrupted\n")
        code = bounds.exit_code()
    sys.exit(code)


def _interrupted(signum, frame):
    if bounds.forked():  # a child not yet exec'd: its parent stops it (bounds.forked)
        return
    bounds.noted(signum)
    raise KeyboardInterrupt


def interrupted(error):
    """Whether `error` was raised while a Ctrl-C or SIGTERM (KeyboardInterrupt) was unwinding
    the stack, by a close in the clean-up, say: then the interrupt is what happened."""
    return bounds.unwinding(error, KeyboardInterrupt)

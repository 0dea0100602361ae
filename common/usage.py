"""Bad command lines in one line, for the scripts that do not load libfabric to parse their
flags (common/cli's parser does: a chapter's flags name providers). The standard library
only."""
import argparse
import re


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


def parse_size(text):
    """'65536', '64K', '1M', '2G' -> bytes (powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: '{text}' (e.g. 4096, 64K, 1M)")
    return int(m[1]) << {"": 0, "K": 10, "M": 20, "G": 30}[m[2].upper()]

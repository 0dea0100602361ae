"""Bad command lines in one line, for the scripts that do not load libfabric to parse their
flags (common/cli's parser does: a chapter's flags name providers). The standard library
only."""
import argparse


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

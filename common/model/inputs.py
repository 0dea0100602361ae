"""The model's inputs, read from a results folder: the blog's p5 figures and our
measurements, or an exit with one line saying what is wrong with them (what
scripts/calibrate.py and scripts/journey.py read first)."""
import json
import sys
from contextlib import contextmanager
from pathlib import Path

from common.model import calibration


@contextmanager
def one_line(path):
    """Exit with one line saying what is wrong with the file(s) at `path`."""
    me = Path(sys.argv[0]).stem
    try:
        yield
    except OSError as e:
        sys.exit(f"{me}: cannot read {e.filename}: {e.strerror}")
    except json.JSONDecodeError as e:
        sys.exit(f"{me}: {path} is not JSON: {e}")
    except ValueError as e:  # a measurement of the wrong run
        sys.exit(f"{me}: {e}")
    except (KeyError, TypeError) as e:
        sys.exit(f"{me}: {path} lacks {e}")


def load(results):
    """The blog's figures and our measurements, or exit with one line saying what is wrong."""
    path = Path(results) / "blog_p5.json"
    with one_line(path):
        blog = calibration.load_blog(results)
        calibration.blog_facts(blog)
        missing = [c for c in calibration.CHAPTERS if c not in blog["chapters"]]
    if missing:
        sys.exit(f"{Path(sys.argv[0]).stem}: {path} has no figure for chapter(s) {', '.join(missing)}")
    files = [str(Path(results) / name)
             for name in (calibration.ATOMIC, calibration.ALONE, calibration.CROWDED)]
    with one_line(" or ".join(files)):
        ours = calibration.measured(results)
    return blog, ours

"""Calibrate the model of the p5 run on the blog's figures and print the prediction table.

    .venv/bin/python scripts/calibrate.py                 # writes results/model/calibration.json
    .venv/bin/python scripts/calibrate.py --results DIR   # reads DIR/blog_p5.json and the measurements
                                                # common/model/calibration.py names;
                                                # writes DIR/model/
    .venv/bin/python scripts/calibrate.py --fit-crowd     # the other choice, crowd fitted on 13: printed only
    .venv/bin/python scripts/calibrate.py --ladder        # the measured costs fitted instead, one chapter
                                                # more each time: what the aim would take

Three CPU costs are measured on our machines, two parameters are fitted on a
chapter each, the other six chapters are predicted (common/model/calibration.py
says which and why).
"""
import argparse
import json
import sys
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.model import calibration  # noqa: E402


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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "results"), help="folder with blog_p5.json")
    p.add_argument("--fit-crowd", action="store_true",
                   help="print the table with crowd fitted on 13 instead of measured; write nothing")
    p.add_argument("--ladder", action="store_true",
                   help="print the tables with op_us, then crowd, then atomic_us fitted (3, 4 "
                   "and 5 fits, past the rule of three); write nothing")
    args = p.parse_args()
    if args.ladder:
        for fits, result in zip(calibration.LADDER, calibration.ladder(*load(args.results))):
            print(f"{len(fits)} fits: " + ", ".join(f"{name} on {chapter}"
                                                    for name, chapter, _ in fits))
            print(calibration.table(result) + "\n")
        return
    if args.fit_crowd:
        print(calibration.table(calibration.calibrate_fitting_crowd(*load(args.results))))
        return
    result = calibration.calibrate(*load(args.results))
    out = Path(args.results) / "model" / "calibration.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(calibration.table(result))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

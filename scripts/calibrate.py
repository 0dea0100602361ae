"""Calibrate the model of the p5 run on the blog's figures and print the prediction table.

    python scripts/calibrate.py                 # writes results/model/calibration.json
    python scripts/calibrate.py --results DIR   # reads DIR/blog_p5.json, writes DIR/model/

Three chapters are fitted, two are described by a parameter of their own,
the others are predicted (common/calibration.py says which and why).
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common import calibration  # noqa: E402


def load(results):
    """The blog's figures, or exit with one line saying what is wrong with them."""
    path = Path(results) / "blog_p5.json"
    try:
        blog = calibration.load_blog(results)
        calibration.blog_facts(blog)
        missing = [c for c in calibration.CHAPTERS if c not in blog["chapters"]]
    except OSError as e:
        sys.exit(f"{Path(sys.argv[0]).stem}: cannot read {path}: {e.strerror}")
    except ValueError as e:
        sys.exit(f"{Path(sys.argv[0]).stem}: {path} is not JSON: {e}")
    except (KeyError, TypeError) as e:
        sys.exit(f"{Path(sys.argv[0]).stem}: {path} lacks {e}")
    if missing:
        sys.exit(f"{Path(sys.argv[0]).stem}: {path} has no figure for chapter(s) {', '.join(missing)}")
    return blog


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "results"), help="folder with blog_p5.json")
    args = p.parse_args()
    result = calibration.calibrate(load(args.results))
    out = Path(args.results) / "model" / "calibration.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(calibration.table(result))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

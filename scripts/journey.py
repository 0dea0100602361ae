"""Draw the journey: the blog's p5 figures, the model's, ours and yours, chapter by chapter.

    .venv/bin/python scripts/journey.py                     # results/ -> results/journey.png
    .venv/bin/python scripts/journey.py --results DIR --out FILE.png

Ours: every results/<NN_name>/<setup>.json and results/progression/ at 64 KiB, as % of
the baseline measured in the same setup (scripts/bench.py and scripts/progression.py write
both). Yours: the --json runs of chapters in results/runs/ that name a baseline.
"""
import argparse
import sys
from pathlib import Path

from common import usage
from common.model import calibration, journey
from common.model.inputs import load
from common.records import ROOT


def main():
    p = usage.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "results"), help="folder of results")
    p.add_argument("--out", help="the PNG to write (default: RESULTS/journey.png)")
    args = p.parse_args()
    blog, measured = load(args.results)
    out = Path(args.out or Path(args.results) / "journey.png")
    if out.suffix.lower() != ".png" or not out.parent.is_dir():
        sys.exit(f"journey: --out must be a .png in an existing folder, not {out}")
    ours = journey.measured(args.results)
    mine = journey.yours(args.results)
    journey.plot(blog, calibration.calibrate(blog, measured), ours, mine, out)
    print(f"wrote {out} ({len(ours)} setups of ours: {', '.join(sorted(ours)) or 'none'}; "
          f"{len(mine)} runs of yours in results/runs/)")


if __name__ == "__main__":
    usage.run(main)

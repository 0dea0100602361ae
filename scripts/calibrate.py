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
from pathlib import Path

from common import usage
from common.model import calibration
from common.model.inputs import load
from common.records import ROOT


def main():
    p = usage.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    usage.run(main)

"""Execute every notebook in notebooks/ in place, so the outputs committed match results/.

    .venv/bin/python scripts/run_notebooks.py            # after scripts/bench.py added results
    .venv/bin/python scripts/run_notebooks.py journey    # only notebooks/journey.ipynb

The tests execute the notebooks too, on a copy; this writes the outputs back. Runs of your
own in results/runs/ are plotted too: it says so, since outputs meant for git should not
carry them (move the folder aside first).
"""
import asyncio
import sys
import tempfile
import warnings
from pathlib import Path

from common import bounds, usage

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

# A Ctrl-C between nbclient making its run (a coroutine) and starting it leaves the run never
# started; Python would say so at exit, after our one line. Nothing was lost: not a warning.
warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)


def main():
    p = usage.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", metavar="NOTEBOOK",
                   help="notebooks/NOTEBOOK.ipynb to run (default: every one)")
    names = p.parse_args().names
    try:  # the test extras, which scripts/setup.sh installs: --help works without them
        import nbclient
        import nbformat
    except ImportError as e:
        sys.exit(f"run_notebooks: {e.name} is missing: .venv/bin/python -m pip install -e "
                 "'.[test]' (scripts/setup.sh does)")
    paths = [NOTEBOOKS / f"{n}.ipynb" for n in names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        sys.exit(f"run_notebooks: no {', '.join(missing)} in notebooks/")
    yours = sorted((ROOT / "results" / "runs").glob("*.json"))
    if yours:
        print(f"run_notebooks: the outputs include your {len(yours)} runs in results/runs/",
              file=sys.stderr)
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        # The kernel's own stderr (a cell's goes into the notebook): its start-up warnings,
        # and a traceback of its own when it is shut down mid-cell. Shown if it fails.
        with tempfile.TemporaryFile("w+") as kernel_log:
            try:
                nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                        resources={"metadata": {"path": str(NOTEBOOKS)}}
                                        ).execute(stderr=kernel_log)
            except nbclient.exceptions.CellExecutionError as e:
                sys.exit(f"{path.name}: {str(e).strip().splitlines()[-1]}")
            except (Exception, asyncio.CancelledError) as e:  # the latter is no Exception
                # nbclient takes Ctrl-C and SIGTERM itself: it shuts the kernel down and
                # cancels the run, which then fails its own way, or is the cancellation
                # itself while the kernel starts (exit 130 for either: it says not which)
                if bounds.unwinding(e, asyncio.CancelledError):
                    raise KeyboardInterrupt from None
                kernel_log.seek(0)
                sys.stderr.write(kernel_log.read())
                raise
        for cell in notebook.cells:
            cell.metadata.pop("execution", None)  # timestamps: noise in every diff
        nbformat.write(notebook, path)
        print(f"ran {path.relative_to(NOTEBOOKS.parent)}")


if __name__ == "__main__":
    usage.run(main)

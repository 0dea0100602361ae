"""Execute every notebook in notebooks/ in place, so the outputs committed match results/.

    .venv/bin/python scripts/run_notebooks.py            # after scripts/bench.py added results
    .venv/bin/python scripts/run_notebooks.py journey    # only notebooks/journey.ipynb

The tests execute the notebooks too, on a copy; this writes the outputs back.
"""
import sys
from pathlib import Path

import nbclient
import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def main():
    names = sys.argv[1:]
    paths = [NOTEBOOKS / f"{n}.ipynb" for n in names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        sys.exit(f"run_notebooks: no {', '.join(missing)} in notebooks/")
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        try:
            nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                    resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
        except nbclient.exceptions.CellExecutionError as e:
            sys.exit(f"{path.name}: {str(e).strip().splitlines()[-1]}")
        for cell in notebook.cells:
            cell.metadata.pop("execution", None)  # timestamps: noise in every diff
        nbformat.write(notebook, path)
        print(f"ran {path.relative_to(NOTEBOOKS.parent)}")


if __name__ == "__main__":
    main()

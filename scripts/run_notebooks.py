"""Execute every notebook in notebooks/ in place, so the outputs committed match results/.

    python scripts/run_notebooks.py            # after scripts/bench.py added results

The tests execute the notebooks too, on a copy; this writes the outputs back.
"""
import sys
from pathlib import Path

import nbclient
import nbformat

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def main():
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
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

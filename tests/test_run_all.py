"""Every notebook and solution runs from top to bottom as JupyterLab's Run All and `jupyter nbconvert
--execute` run it: nbclient, the `python3` kernel of this environment, the notebook's own folder as the
working directory, and a cell that raises stopping the run unless it carries the `raises-exception` tag.

Outputs are not compared (strict nbval does that) and the notebooks are never written back. One test per
notebook, so a slow chapter shows its own time (`pytest --durations=0`).
"""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted(
    (ROOT / "notebooks" / "solutions").glob("*.ipynb")
)
CELL_TIMEOUT = 600  # seconds, as `make test` gives nbval


def _id(path: Path) -> str:
    return path.relative_to(ROOT / "notebooks").as_posix()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_run_all_goes_top_to_bottom(path):
    nb = nbformat.read(path, as_version=4)
    at = {"cell": None}

    def on_cell_start(cell, cell_index):
        at["cell"] = cell_index

    client = nbclient.NotebookClient(
        nb,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",  # "python" in its kernelspec: jupyter_client starts this interpreter
        resources={"metadata": {"path": str(path.parent)}},  # the kernel's working directory
        on_cell_start=on_cell_start,
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as err:
        pytest.fail(
            f"{_id(path)}: Run All stops at cell {at['cell']} (no raises-exception tag):\n{err}",
            pytrace=False,
        )
    except (TimeoutError, nbclient.exceptions.DeadKernelError) as err:
        pytest.fail(f"{_id(path)}: cell {at['cell']}: {type(err).__name__}: {err}", pytrace=False)
    assert at["cell"] is not None, f"{_id(path)} has no code cell"

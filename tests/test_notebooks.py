"""The notebooks as a learner opens them: JupyterLab's Run All (and nbconvert/nbclient) must go from top to
bottom, and opening a notebook must not change the file.

Strict nbval re-runs every cell and compares its output with the stored one, so a cell that raises now
raised when the notebook was executed too; what nbval alone cannot see is whether Run All would stop
there. Run All stops at the first cell that raises unless the cell carries the `raises-exception` tag.
"""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted(
    (ROOT / "notebooks" / "solutions").glob("*.ipynb")
)
KERNEL = "Python 3 (ipykernel)"  # the display name of the kernel that ipykernel installs


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_run_all_does_not_stop(path):
    nb = json.loads(path.read_text())
    stops = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        raised = any(out["output_type"] == "error" for out in cell.get("outputs", []))
        tagged = "raises-exception" in cell["metadata"].get("tags", [])
        if raised != tagged:
            stops.append(
                f"cell {index}: {'raises without' if raised else 'carries'} the raises-exception tag"
            )
        if "NBVAL_RAISES_EXCEPTION" in "".join(cell["source"]):
            stops.append(f"cell {index}: NBVAL_RAISES_EXCEPTION comment (only nbval reads it; use the tag)")
    assert not stops, "\n".join(stops)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_every_cell_is_stored_executed_and_opening_changes_nothing(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"] == {"display_name": KERNEL, "language": "python", "name": "python3"}
    unexecuted = [
        i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and c["execution_count"] is None
    ]
    assert not unexecuted, f"cells stored without being executed (nbval would not compare them): {unexecuted}"


CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=_id)
def test_every_chapter_has_the_map_and_a_summary(path):
    """Where you are (the course map under the title) and what you take away (a three-to-five-bullet
    summary before the exercises)."""
    cells = ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]
    assert cells[1].startswith("**Course map**"), "cell 1 is not the course map"
    number = path.name.split("_")[0]
    assert f"**{number} " in cells[1], f"the map does not mark chapter {number} as the current one"
    (summary,) = [c for c in cells if c.startswith("## Summary")]
    bullets = [line for line in summary.splitlines() if line.startswith("- ")]
    assert 3 <= len(bullets) <= 5, f"the summary has {len(bullets)} bullets"

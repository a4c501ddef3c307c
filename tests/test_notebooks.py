"""The example notebooks run top to bottom on the embedded model (nbclient), as a newcomer would run them.

Each notebook asserts its own claims (identical outputs, the edit it asked for, which run copies more), so running
it without errors is the test. They run from examples/ (they read configs/ relative to it), on a kernel that
imports lookupdec from this checkout, and are not written back: their stored outputs are refreshed by hand.
Measured on the project's 2-core CPU, one torch thread: 01 22 s, 02 15 s, 03 25 s, 04 38 s (102 s for the file,
the model load included).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # a cell that hangs fails the test instead of the CI run

pytestmark = pytest.mark.slow


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3, NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, monkeypatch, smollm2):  # smollm2: skipped like the other tests without the model
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(EXAMPLES.parent),
                                                                 os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(EXAMPLES)}})
    started = time.perf_counter()
    client.execute()  # raises CellExecutionError, with the cell and its traceback, when a cell fails
    print(f"{name}: {time.perf_counter() - started:.1f} s")
    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.output_type == "error"]
    html = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert any('class="ld-trace"' in page for page in html), "every notebook shows a trace"

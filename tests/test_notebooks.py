"""The notebooks of notebooks/, executed in a real Jupyter kernel (nbclient
and ipykernel) with small sizes through their parameter cell, and their
outputs checked: the book's closing line, tqdm's progress widget, the live
figure (a PNG that dp.train updated in place), the timeline's figure, the
scaling report. The committed notebooks hold no outputs: what a reader sees is
what this execution produces.

nbclient, nbformat, ipykernel, ipywidgets and matplotlib are test
requirements (requirements-dev.txt): without them these tests fail, they do
not skip.
"""
import base64
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
BOOK_LINE = re.compile(r"test acc: \d\.\d\d, \d+\.\d sec/epoch on \['cpu:0', 'cpu:1'\]")
SMALL = {
    "chapter12_5_multiple_devices.ipynb": {"DPCORE_NB_EPOCHS": "2", "DPCORE_NB_TRAIN_SAMPLES": "2048",
                                           "DPCORE_NB_TEST_SAMPLES": "512", "DPCORE_NB_REPORT_STEPS": "2"},
    "chapter12_6_resnet18.ipynb": {"DPCORE_NB_EPOCHS": "1", "DPCORE_NB_TRAIN_SAMPLES": "256",
                                   "DPCORE_NB_TEST_SAMPLES": "128", "DPCORE_NB_REPORT_STEPS": "1"},
}


def test_there_are_the_two_chapters_and_they_are_stored_without_outputs():
    import nbformat

    assert [os.path.basename(p) for p in NOTEBOOKS] == sorted(SMALL)
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{path}: a cell holds outputs"


def execute(path, tmp_path, monkeypatch):
    import nbclient
    import nbformat

    for key, value in SMALL[os.path.basename(path)].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return nb


def outputs_of(nb):
    return [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]


def text_of(outputs):
    parts = []
    for out in outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out and "text/plain" in out.data:
            parts.append(out.data["text/plain"])
    return "\n".join(parts)


def pngs_of(outputs):
    return [base64.b64decode(out.data["image/png"]) for out in outputs if "data" in out and "image/png" in out.data]


# ResNet-18's notebook trains on every core: run alone (make test), beside another worker it took 2x its time
@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.alone) if "resnet18" in p else p for p in NOTEBOOKS],
                         ids=os.path.basename)
def test_notebook_runs_and_shows_the_book_line_the_bar_and_the_figures(path, tmp_path, monkeypatch):
    nb = execute(path, tmp_path, monkeypatch)
    outputs = outputs_of(nb)
    errors = [out for out in outputs if out.output_type == "error"]
    assert not errors, errors
    text = text_of(outputs)
    assert BOOK_LINE.search(text), text[-3000:]
    widgets = [out for out in outputs if "data" in out and "application/vnd.jupyter.widget-view+json" in out.data]
    assert widgets, "no progress widget: tqdm did not draw its notebook bar"
    pngs = pngs_of(outputs)
    assert len(pngs) >= 2 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs), len(pngs)
    # the live figure: dp.train's display, updated in place after every epoch (one output, not one per epoch)
    train_cell = next(cell for cell in nb.cells if "dp.train(" in cell.source and "plot=True" in cell.source)
    figures = [out for out in train_cell.outputs if "data" in out and "image/png" in out.data]
    assert len(figures) == 1, [out.output_type for out in train_cell.outputs]
    assert "steps on 2 replica(s)" in text and "| replicas | devices | images/s |" in text, text[-3000:]

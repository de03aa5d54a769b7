"""The notebooks in notebooks/ run top to bottom without errors.

Each is executed by nbclient on an ipykernel running this very Python (the .venv), so
the installed placements2jax is the one tested. The notebooks are committed with their
outputs so they read well on GitHub; ``python tests/test_notebooks.py`` re-executes them
and saves the new outputs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
KERNEL = "placements2jax-venv"
# Optional extras a notebook imports.
NEEDS = {"01_quickstart.ipynb": ("matplotlib",), "02_cross_check_torch.ipynb": ("torch",),
         "04_auto_plan.ipynb": ("matplotlib", "optax")}
CELL_TIMEOUT = 120


def install_kernel(directory: Path) -> None:
    """A kernelspec that runs ipykernel on this Python; put ``directory`` on JUPYTER_PATH."""
    spec = directory / "kernels" / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))


def execute(path: Path) -> nbformat.NotebookNode:
    """Run the notebook in its own folder; raises CellExecutionError on the first failing cell."""
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name=KERNEL,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return notebook


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    directory = tmp_path_factory.mktemp("jupyter")
    install_kernel(directory)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JUPYTER_PATH", str(directory))
        yield


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")))
def test_notebook_runs_without_errors(name: str, kernel: None) -> None:
    for module in NEEDS.get(name, ()):
        pytest.importorskip(module)
    notebook = execute(NOTEBOOKS / name)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count for cell in code)
    errors = [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert not errors
    first = code[0].source
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in first, "the first cell must give JAX 8 CPU devices"


def test_notebooks_are_there() -> None:
    assert sorted(p.name for p in NOTEBOOKS.glob("*.ipynb")) == [
        "01_quickstart.ipynb",
        "02_cross_check_torch.ipynb",
        "03_inference.ipynb",
        "04_auto_plan.ipynb",
    ]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as jupyter_path:
        install_kernel(Path(jupyter_path))
        os.environ["JUPYTER_PATH"] = jupyter_path
        for path in sorted(NOTEBOOKS.glob("*.ipynb")):
            executed = execute(path)
            executed.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
            nbformat.write(executed, path)
            print("executed and saved", path.name)

"""The package as a user gets it: a wheel and an sdist build, and the wheel installed into a
clean virtual environment with only the core dependencies imports and runs the README example.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from test_docs import code_blocks

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements-lock.txt"
CORE = {"jax", "jaxlib", "numpy", "ml-dtypes", "opt-einsum", "scipy"}


def run(command: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("build", reason="the 'build' package is in the test extra")
    out = tmp_path_factory.mktemp("dist")
    leftovers = set(ROOT.glob("*.egg-info"))
    run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], ROOT)
    for made in set(ROOT.glob("*.egg-info")) - leftovers:  # the sdist step writes it into the checkout
        shutil.rmtree(made, ignore_errors=True)
    return out


def test_sdist_carries_license_and_sources(dist: Path) -> None:
    (sdist,) = dist.glob("placements2jax-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "pyproject.toml", "placements2jax/__init__.py", "placements2jax/py.typed"} <= names


def test_wheel_metadata(dist: Path) -> None:
    (wheel,) = dist.glob("placements2jax-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = email.message_from_string(archive.read(info).decode())
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.11"
    classifiers = metadata.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers and "Typing :: Typed" in classifiers
    extras = set(metadata.get_all("Provides-Extra"))
    assert {"torch", "plot", "rich", "train", "test"} <= extras
    assert "placements2jax/py.typed" in names


@pytest.mark.timeout(900)
def test_wheel_in_a_clean_venv_runs_the_readme_example(dist: Path, tmp_path: Path) -> None:
    (wheel,) = dist.glob("placements2jax-*.whl")
    # A fresh interpreter outside the source tree, with nothing injected (the test run's
    # PYTHONPATH would show pip the checkout as placements2jax already installed): the example
    # sets up its 8 CPU devices itself, as a user's script would.
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "XLA_FLAGS")}
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--quiet", "-c", str(LOCK), str(wheel)], tmp_path, env)

    frozen = run([str(python), "-m", "pip", "list", "--format=freeze"], tmp_path, env)
    installed = {line.split("==")[0].lower().replace("_", "-") for line in frozen.split()}
    installed -= {"pip", "setuptools", "placements2jax"}
    assert installed == CORE, f"the core install pulled in {sorted(installed - CORE)}"

    (source, expected), *_ = code_blocks((ROOT / "README.md").read_text())
    where = run([str(python), "-c", "import placements2jax; print(placements2jax.__file__)"], tmp_path, env)
    assert where.startswith(str(venv))
    printed = run([str(python), "-c", source], tmp_path, env)
    assert expected is not None and printed.rstrip() == expected.rstrip()

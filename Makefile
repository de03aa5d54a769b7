# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The demo needs the core and its display/training extras only; the tests need every extra
# (torch cross-checks, notebooks, docs, model libraries).
DEMO_EXTRAS ?= train,plot,rich
EXTRAS ?= test,train,torch,plot,rich,docs,bench
# torch: the tests need only its CPU build. The lock's torch==2.13.0 matches both the CPU
# wheel 2.13.0+cpu and PyPI's 2.13.0 (on Linux x86_64 the CUDA build, with GBs of nvidia
# packages), and pip installs the highest match it can see; nothing in this Makefile chooses.
# On the machines this project is developed and tested on (CI included), pip's own
# configuration (/etc/pip.conf and PIP_FIND_LINKS: find-links /opt/wheels) offers a local
# torch-2.13.0+cpu wheel, which pip prefers to PyPI's 2.13.0 (a local version label sorts
# higher), so that is what `make test` installs there. Elsewhere, offer torch's CPU index:
# `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu` (off by default and untested
# here: download.pytorch.org does not resolve from these machines).
TORCH_INDEX ?=
# The suite runs on TEST_WORKERS processes (pytest-xdist; CI has 2 cores), each test file whole
# on one worker (module fixtures built once), slowest files first (tests/conftest.py).
TEST_WORKERS ?= 2
# Extra pytest options for one run, e.g. `make test PYTEST_ARGS=--junitxml=junit.xml` to re-measure
# the per-file durations behind tests/conftest.py's SLOW_FILES (CI passes none).
PYTEST_ARGS ?=
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: demo test bench docs install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Not --quiet: a first install takes a while, and pip's own lines show its progress.
$(DEMO_STAMP): $(BIN)/python pyproject.toml requirements-lock.txt
	@echo "Installing placements2jax with the demo's extras ($(DEMO_EXTRAS)) into $(VENV) ..."
	$(BIN)/python -m pip install --progress-bar on -c requirements-lock.txt -e ".[$(DEMO_EXTRAS)]"
	touch $(DEMO_STAMP)

$(STAMP): $(BIN)/python pyproject.toml requirements-lock.txt
	@echo "Installing placements2jax with every extra ($(EXTRAS)) into $(VENV) ..."
	$(BIN)/python -m pip install --progress-bar on -c requirements-lock.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -e ".[$(EXTRAS)]"
	touch $(STAMP) $(DEMO_STAMP)

install: $(STAMP)

# The main job: one training run (placements2jax.train_demo); `placements2jax demo` is the
# shorter layout demo (a tensor-parallel MLP with DTensor operators, step by step).
demo: $(DEMO_STAMP)
	$(BIN)/python -m placements2jax train

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

docs: $(STAMP)
	$(BIN)/python -m mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build site *.egg-info

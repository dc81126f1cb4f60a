# ProtoFleet developer entry points. The virtual environment is made once and reused;
# it is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that lies on this machine's disk; override for other platforms,
# e.g. `make TORCH_SPEC='torch>=2.1,<3' test`.
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= agent,coordinator,export,imagenet,fleet,dev
STAMP := $(VENV)/.protofleet-installed

.PHONY: demo test test-fast lint fmt bench bench-accuracy bench-closed-form figures venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the local wheel, so nothing later pulls a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/edge-fleet demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: lint
	$(VENV)/bin/pytest -q

# The quick loop while working: every package's fast tests, no lint.
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

# Each writes only what it measured, with date, commit and machine; `make figures` then
# rewrites the generated blocks of README.md and docs/ from the results files.
bench: $(STAMP)
	$(PY) bench/run.py

bench-accuracy: $(STAMP)
	$(PY) bench/run.py --suite accuracy

bench-closed-form: $(STAMP)
	$(PY) bench/run.py --suite closed-form

figures: $(STAMP)
	$(PY) -m bench.figures

clean:
	rm -rf $(VENV) build *.egg-info

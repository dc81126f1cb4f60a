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

.PHONY: demo test test-fast test-lowest lint fmt bench bench-accuracy bench-closed-form bench-peer figures gpu-check venv clean

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

# The project at the lowest versions pyproject.toml declares (uv's lowest-direct
# resolution: every direct dependency at its floor), in a venv of its own, made afresh:
# the console scripts load, and the fast agent and coordinator tests pass. torch stays
# the local CPU wheel (installed first and pinned), so nothing pulls a CUDA build.
LOWEST_VENV ?= .venv-lowest
LOWEST_EXTRAS ?= agent,coordinator,export,imagenet,fleet,dev
LOWEST_TESTS ?= tests/test_agent_*.py tests/test_coordinator_*.py tests/test_probe.py
test-lowest:
	rm -rf $(LOWEST_VENV)
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install --quiet '$(TORCH_SPEC)' 'uv>=0.5'
	echo '$(TORCH_SPEC)' > $(LOWEST_VENV)/torch-constraint.txt
	$(LOWEST_VENV)/bin/uv pip install --quiet --python $(LOWEST_VENV)/bin/python \
		--resolution lowest-direct --constraint $(LOWEST_VENV)/torch-constraint.txt \
		-e '.[$(LOWEST_EXTRAS)]'
	for tool in edge-export edge-agent edge-coordinator edge-fleet; do \
		$(LOWEST_VENV)/bin/$$tool --help >/dev/null || exit 1; done
	$(LOWEST_VENV)/bin/python -c "import protocol, runtime.bulkread, export.runtime, edge_agent.agent, coordinator.service.service, fleet.cli.main"
	$(LOWEST_VENV)/bin/pytest -q -m "not slow" -p no:cacheprovider $(LOWEST_TESTS)

# On a machine with a working CUDA (or TensorRT) provider: the doctor, fp16 parity, the
# like-for-like GPU benchmark and a memory-transport fleet, written as the `gpu` section
# of bench/results.json. Elsewhere it says there is no GPU, in one line, and exits 0.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check

# Each writes only what it measured, with date, commit and machine; `make figures` then
# rewrites the generated blocks of README.md and docs/ from the results files.
bench: $(STAMP)
	$(PY) bench/run.py

bench-accuracy: $(STAMP)
	$(PY) bench/run.py --suite accuracy

bench-closed-form: $(STAMP)
	$(PY) bench/run.py --suite closed-form

# The Flower side by side alone (bench/peer_bench.py, 35-60 minutes on 2 cores), with
# the optional peer extra installed into the venv for it: Flower stays out of the default
# extras, and `make bench` without it records the section as skipped. Written to its own
# file (PEER_OUT), since a results file holds only the sections its run measured.
PEER_OUT ?= bench/peer.json
bench-peer: $(STAMP)
	$(PY) -m pip install --quiet -e '.[$(EXTRAS),peer]'
	$(PY) bench/run.py --only bench.peer_bench --out $(PEER_OUT)

figures: $(STAMP)
	$(PY) -m bench.figures

clean:
	rm -rf $(VENV) build *.egg-info

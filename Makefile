# Two commands work on a fresh clone of a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install train test benchmarks clean

install: $(STAMP)

# torch is pinned (a looser requirement pulls a multi-GB CUDA build); DeepSpeed installs as pure
# Python (DS_BUILD_OPS=0) and compiles an op only where one is used. Re-runs only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	DS_BUILD_OPS=0 $(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

train: install
	$(VENV)/bin/mgpu-train

test: install
	$(PY) -m pytest -q tests

benchmarks: install
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/zero_memory.py
	$(PY) benchmarks/tp_vs_dtensor.py
	$(PY) benchmarks/pipeline_bubble.py
	$(PY) benchmarks/checkpoint_io.py
	$(PY) benchmarks/checkpoint_verify.py
	$(PY) benchmarks/context_parallel.py
	$(PY) benchmarks/activation_memory.py
	$(PY) benchmarks/planner_calibration.py
	$(PY) benchmarks/compile_blocks.py

clean:
	rm -rf $(VENV) outputs multirun build *.egg-info

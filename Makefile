# Two commands work on a fresh clone of a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install train test benchmarks measurements measurements-page gpu-check clean

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

# Three workers (pytest-xdist) on two cores, each test file on one of them: a test that waits (a timeout, a launcher
# starting interpreters) leaves the cores to the other workers' tests. On 2 cores, the same tests: 1070 s in one
# process, 778-812 s on two workers, 696 s on three (docs: testing).
TEST_WORKERS ?= 3
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

# Every CPU benchmark in full (hours on 2 cores); `make test` runs each in its --smoke mode.
CPU_BENCHMARKS := overhead zero_memory tp_vs_dtensor pipeline_bubble pipeline_in_flight checkpoint_io \
	checkpoint_verify context_parallel activation_memory planner_calibration compile_blocks document_mask setup_memory \
	replica_updates async_checkpoint chaos_goodput moe_throughput hf_step_time resilience_cost muon_step fault_matrix \
	hf_families lora_step fp8_curve hf_moe_ep tp_vs_hf_tp vs_deepspeed_strategy comm_count sft_data fingerprint_step \
	pipeline_overlap

benchmarks: install
	set -e; for b in $(CPU_BENCHMARKS); do echo "== benchmarks/$$b.py"; $(PY) benchmarks/$$b.py; done

# docs/measurements.md from the sections the benchmarks wrote in docs/measurements/ (seconds; benchmarks/record.py).
# Each benchmark run in full rewrites its own section; `make measurements` runs the CPU set first (hours on 2 cores).
measurements-page:
	$(PY) benchmarks/record.py

measurements: benchmarks
	$(PY) benchmarks/record.py

# On one CUDA GPU: the CUDA tests and the GPU benchmarks, one table (refuses without CUDA), recorded as the page's
# GPU section; its status is the check's.
gpu-check: install
	$(PY) benchmarks/gpu_check.py; status=$$?; [ $$status = 2 ] || $(PY) benchmarks/record.py; exit $$status

clean:
	rm -rf $(VENV) outputs multirun build *.egg-info

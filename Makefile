# Every target runs in the project's own venv, .venv/, which the first `make` creates and later
# ones keep up to date (tools/setup-venv.sh: re-installs only when pyproject.toml changes).
# PY=/path/to/python runs the targets in an existing environment instead, with no set-up.
VENV := .venv
ifeq ($(origin PY),undefined)
PY := $(VENV)/bin/python
SETUP := venv
endif

.PHONY: venv demo demo-ep demo-dsv3 test test-fast lint

venv:  ## make .venv/ (or bring it up to date); the other targets do this themselves
	@bash tools/setup-venv.sh $(VENV)

demo: $(SETUP)  ## train the debug Qwen3-MoE on 2 CPU ranks (README: how long it took)
	$(PY) -m torch.distributed.run --nproc_per_node=2 train.py --config configs/debug_qwen3_moe.toml

demo-ep: $(SETUP)  ## the same model with experts split over ep=2 (4 CPU ranks)
	$(PY) -m torch.distributed.run --nproc_per_node=4 train.py --config configs/debug_qwen3_moe.toml --parallel.ep=2 --job.output_dir=outputs/debug_qwen3_moe_ep2

demo-dsv3: $(SETUP)  ## the debug DeepSeek-V3 (MLA, bias-balanced routing, MTP) on 2 CPU ranks
	$(PY) -m torch.distributed.run --nproc_per_node=2 train.py --config configs/debug_deepseek_v3.toml

test: $(SETUP)  ## the whole suite (unit + multi-process gloo + HF parity), 15 slowest listed
	$(PY) -m pytest -q --durations=15 tests

test-fast: $(SETUP)  ## everything but the multi-process runs (`slow`), 15 slowest listed
	$(PY) -m pytest -q --durations=15 -m "not slow" tests

lint: $(SETUP)
	$(PY) -m ruff check . && $(PY) -m ruff format --check .

PY ?= python

.PHONY: demo demo-ep demo-dsv3 test test-fast lint

demo:  ## train the debug Qwen3-MoE on 2 CPU ranks (under 3 minutes)
	$(PY) -m torch.distributed.run --nproc_per_node=2 train.py --config configs/debug_qwen3_moe.toml

demo-ep:  ## the same model with experts split over ep=2 (4 CPU ranks)
	$(PY) -m torch.distributed.run --nproc_per_node=4 train.py --config configs/debug_qwen3_moe.toml --parallel.ep=2 --job.output_dir=outputs/debug_qwen3_moe_ep2

demo-dsv3:  ## the debug DeepSeek-V3 (MLA, bias-balanced routing, MTP) on 2 CPU ranks
	$(PY) -m torch.distributed.run --nproc_per_node=2 train.py --config configs/debug_deepseek_v3.toml

test:  ## the whole suite (unit + multi-process gloo + HF parity)
	$(PY) -m pytest -q tests

test-fast:  ## everything but the multi-process end-to-end runs
	$(PY) -m pytest -q -m "not slow" tests

lint:
	ruff check . && ruff format --check .

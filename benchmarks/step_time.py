"""Training-step speed and memory of a config, and our model vs its transformers counterpart.

    python benchmarks/step_time.py --config configs/debug_qwen3_moe.toml [--section.key=value ...]
    torchrun --nproc_per_node=N benchmarks/step_time.py --config ...   (the step part, any layout)

Prints one JSON object, then a one-line summary. Flags of this script (not config keys):
--warmup=K (untimed steps, default 2), --measure=M (timed steps, default 5),
--hf-compare=true|false (default true when transformers is installed; single process only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moetrain.config import load_config  # noqa: E402
from moetrain.parallelisms.dims import ParallelDims, world_size_from_env  # noqa: E402


def pop_flag(argv: list[str], name: str, default: str) -> str:
    """Take `--name=value` (a flag of the script, not a config key) out of argv."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            argv.pop(i)
            return arg.split("=", 1)[1]
    return default


def measure_steps(cfg, warmup: int, measure: int) -> dict:
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer
    from moetrain.metrics.logger import peak_memory_gib

    p = cfg.parallel
    dims = ParallelDims.of(p, world_size_from_env())
    cfg.train.steps = warmup + measure
    cfg.train.warmup_steps = min(cfg.train.warmup_steps, cfg.train.steps)
    cfg.metrics.jsonl = False
    corpora = preflight(cfg, dims)
    trainer = Trainer(cfg, dims, corpora)
    times = []
    for i in range(warmup + measure):
        batches = trainer.next_micro_batches()
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.steps.train_step(batches)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return {
        "world_size": dims.world_size,
        "device": str(trainer.device),
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "peak_mem_gib": peak_memory_gib(trainer.device),
        "rank": trainer.rank,
    }


def compare_with_transformers(cfg, iters: int) -> dict:
    """Forward+backward of one micro-batch: our module vs HF's, same weights, same input,
    timed in alternating calls."""
    import transformers

    from moetrain.hf.weights import load_hf_weights
    from moetrain.models import get_model_spec

    spec = get_model_spec(cfg.model.name)
    args = cfg.model.args
    if getattr(args, "num_nextn_predict_layers", 0):  # transformers trains no MTP modules
        args = dataclasses.replace(args, num_nextn_predict_layers=0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    hf_cfg = transformers.AutoConfig.for_model(**spec.hf_adapter.hf_config_dict(args))
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        ours = spec.build(args)
        load_hf_weights(ours, spec.hf_adapter, args, tmp)
    hf_model.to(device).train()
    ours.to(device).train()
    batch = torch.randint(
        0, args.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len), device=device
    )

    def fwd_bwd(run) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run().float().pow(2).mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    # NOTE: interleaved (ours, theirs, ours, ...), not all of ours then all of theirs: on a
    # shared or throttling machine the load drifts over seconds, and back-to-back timing
    # charged the drift to whichever ran second (0.20x read where interleaved reads 1.06x).
    # The median of each side then compares calls made under the same conditions.
    runs = {"ours": lambda: ours(batch).logits, "hf": lambda: hf_model(batch).logits}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(iters + 1):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]  # neither always goes first
        for name in order:
            elapsed = fwd_bwd(runs[name])
            if i:  # the first round warms both up
                times[name].append(elapsed)
    ours_s, hf_s = (statistics.median(times[name]) for name in ("ours", "hf"))
    return {"ours_fwd_bwd_s": ours_s, "transformers_fwd_bwd_s": hf_s, "speedup": hf_s / ours_s}


def main() -> None:
    argv = sys.argv[1:]
    warmup = int(pop_flag(argv, "warmup", "2"))
    measure = int(pop_flag(argv, "measure", "5"))
    try:
        import transformers  # noqa: F401

        has_hf = True
    except ImportError:
        has_hf = False
    hf_compare = pop_flag(argv, "hf-compare", str(has_hf)).lower() == "true"
    cfg = load_config(argv)
    result = {"config": cfg.job.name, **measure_steps(cfg, warmup, measure)}
    import torch.distributed as dist

    single = dist.get_world_size() == 1
    dist.destroy_process_group()
    if result["rank"] != 0:
        return
    if hf_compare and single:
        result["vs_transformers"] = compare_with_transformers(load_config(argv), measure)
    print(json.dumps(result))
    summary = (
        f"{result['config']}: {result['tokens_per_s']:,.0f} tok/s, step "
        f"{1000 * result['step_time_s']:.1f} ms, peak {result['peak_mem_gib']:.2f} GiB "
        f"on {result['world_size']} x {result['device']}"
    )
    if "vs_transformers" in result:
        summary += f"; fwd+bwd {result['vs_transformers']['speedup']:.2f}x transformers"
    print(summary)


if __name__ == "__main__":
    main()

"""FSDP / HSDP on real gloo ranks against one plain process on the same global batch.

The reference is independent of the parallel code: an unsharded model, torch's own
clip_grad_norm_, the global batch read through a one-rank sampler, fp32.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models import get_model_spec
from models.common.moe import load_balancing_loss
from parallelisms.mesh import ParallelDims
from tests.distributed import run_distributed
from trainer.config import load_config
from trainer.data import IGNORE_INDEX, GlobalBatchSampler, build_dataset, build_tokenizer
from trainer.optim import build_optimizer, build_scheduler

STEPS = 3
TINY = [
    "--config=configs/debug_qwen3_moe.toml",
    "--model.hidden_size=64",
    "--model.num_hidden_layers=3",
    "--model.moe_intermediate_size=32",
    "--model.intermediate_size=96",
    "--model.head_dim=16",
    "--model.router_aux_loss_coef=0.05",
    "--data.seq_len=32",
    "--data.max_tokens=60000",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=2",
    "--train.warmup_steps=1",
    "--train.max_grad_norm=0.5",  # small enough that clipping is active
    "--metrics.jsonl=false",
    "--metrics.progress=false",
]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _layout_worker(rank: int, world: int, argv: list[str], out_path: str) -> None:
    from trainer.loop import Trainer, preflight

    cfg = load_config(argv)
    p = cfg.parallel
    dims = ParallelDims.resolve(p.dp_replicate, p.dp_shard, p.cp, p.ep, world)
    preflight(cfg, dims)
    trainer = Trainer(cfg, dims)
    records = []
    for _ in range(STEPS):
        losses = trainer.forward_backward(trainer.next_micro_batches())
        grads = {n: _full(q.grad) for n, q in trainer.model.named_parameters()}
        step = trainer.optimizer_step()
        params = {n: _full(q) for n, q in trainer.model.named_parameters()}
        records.append({**losses, **step, "grads": grads, "params": params})
    if rank == 0:
        torch.save(records, out_path)
    dist.destroy_process_group()


def _reference(argv: list[str]) -> list[dict]:
    """The same training on one process, written without any of the parallel code."""
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    model = spec.model_cls(cfg.model.args)
    model.init_weights(cfg.train.seed)
    opt = build_optimizer(model, cfg.train)
    sched = build_scheduler(opt, cfg.train)
    t = cfg.train
    dataset = build_dataset(cfg.data, build_tokenizer(cfg.data))
    sampler = iter(
        GlobalBatchSampler(
            len(dataset), t.global_batch_size, t.micro_batch_size, 0, 1, t.seed, True
        )
    )
    n_micro = t.global_batch_size // t.micro_batch_size
    records = []
    for _ in range(STEPS):
        micro = [[dataset[i] for i in next(sampler)] for _ in range(n_micro)]
        micro = [{k: torch.stack([s[k] for s in mb]) for k in mb[0]} for mb in micro]
        n_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in micro)
        total_ce, total_aux = 0.0, 0.0
        for mb in micro:
            out = model(mb["input_ids"], mb["position_ids"])
            ce = F.cross_entropy(out.logits.flatten(0, 1), mb["labels"].flatten(), reduction="sum")
            aux = load_balancing_loss(out.router_stats, cfg.model.args.num_experts)
            (ce / n_tokens + cfg.model.args.router_aux_loss_coef * aux / n_micro).backward()
            total_ce, total_aux = total_ce + ce.item(), total_aux + aux.item()
        grads = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad()
        params = {n: q.detach().clone() for n, q in model.named_parameters()}
        records.append(
            {
                "loss": total_ce / n_tokens.item(),
                "aux_loss": total_aux / n_micro,
                "grad_norm": norm.item(),
                "grads": grads,
                "params": params,
            }
        )
    return records


def _assert_tensors_close(ours: dict, ref: dict, what: str, rtol: float) -> None:
    assert ours.keys() == ref.keys()
    for name in ref:
        err = (ours[name] - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)
        assert err <= rtol, f"{what} {name}: relative error {err:.2e} > {rtol}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,layout",
    [
        (2, []),  # FSDP over 2 ranks, grad accumulation 2
        (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]),  # HSDP, no accumulation
    ],
    ids=["fsdp2", "hsdp2x2"],
)
def test_layout_matches_single_process(world, layout, tmp_path):
    argv = TINY + layout
    run_distributed(_layout_worker, world, argv, str(tmp_path / "out.pt"))
    ours = torch.load(tmp_path / "out.pt")
    ref = _reference(argv)
    for step, (o, r) in enumerate(zip(ours, ref, strict=True), start=1):
        assert o["loss"] == pytest.approx(r["loss"], rel=1e-5), f"loss at step {step}"
        assert o["aux_loss"] == pytest.approx(r["aux_loss"], rel=1e-5), f"aux at step {step}"
        assert o["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), f"norm at step {step}"
        assert r["grad_norm"] > 0.5, "clipping should be active in this test"
        _assert_tensors_close(o["grads"], r["grads"], f"step {step} grad", 1e-5)
        _assert_tensors_close(o["params"], r["params"], f"step {step} param", 1e-5)

"""Layout-equivalence harness: a parallel run on real gloo ranks vs one plain process.

The reference is independent of the parallel code: an unsharded model, torch's own
clip_grad_norm_, foreach AdamW, the global batch read through a one-rank sampler, fp32.
Both sides may install the same routing override (forward hooks on the routers, plain
PyTorch API) to force a badly imbalanced routing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.build.float8 import apply_float8
from moetrain.build.lora import apply_lora, init_adapters
from moetrain.build.optimizer import build_optimizer, lr_factor
from moetrain.config import load_config
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.data.sampler import GlobalBatchSampler
from moetrain.data.tokenizers import build_tokenizer
from moetrain.loop.losses import with_mtp_targets
from moetrain.models import get_model_spec
from moetrain.models.common.balance_losses import load_balancing_loss, sequence_balance_loss
from moetrain.models.common.moe import GroupLimitedRouter, MoEOptions, TopKRouter
from moetrain.models.common.replay import is_replay
from moetrain.parallelisms.dims import ParallelDims
from tests.corpus import build_dataset

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
    # Adam's first update is ~lr * g / (|g| + eps): for |g| near eps it turns fp32 round-off
    # into lr-sized parameter differences. A larger eps keeps the update smooth in g, so
    # parameters compare as tightly as the gradients that produced them.
    "--train.eps=1e-4",
    "--metrics.jsonl=false",
    "--metrics.progress=false",
]
# DeepSeek-V3 at the same scale: MLA with q LoRA and v_head_dim != qk_head_dim, 4 groups,
# a shared expert, one dense layer, one MTP module, the sequence-wise aux loss, and a bias
# update rate large enough that the bias changes routing within 3 steps.
TINY_MODEL_ONLY = ("--model.head_dim", "--model.router_aux_loss_coef")
TINY_DSV3 = [
    "--config=configs/debug_deepseek_v3.toml",
    "--model.hidden_size=64",
    "--model.num_hidden_layers=3",
    "--model.moe_intermediate_size=32",
    "--model.intermediate_size=96",
    "--model.q_lora_rank=32",
    "--model.kv_lora_rank=16",
    "--model.qk_nope_head_dim=12",
    "--model.qk_rope_head_dim=4",
    "--model.v_head_dim=8",
    "--model.num_nextn_predict_layers=1",
    "--model.router_aux_loss_coef=0.05",
    "--moe.aux_loss_mode=sequence",
    "--moe.bias_update_rate=0.01",
    *(a for a in TINY[1:] if a.split("=")[0] not in TINY_MODEL_ONLY),
]
ROUTERS = (TopKRouter, GroupLimitedRouter)


def num_experts_of(args) -> int:
    return getattr(args, "num_experts", None) or args.n_routed_experts


def _skew_routing(router: nn.Module, _inputs, out):
    """Send every token only to experts 0..2 (a routing no load balancer would allow)."""
    return out._replace(top_experts=out.top_experts % 3)


def install_routing(model: nn.Module, routing: str | None) -> None:
    if routing == "skewed":
        for module in model.modules():
            if isinstance(module, ROUTERS):
                module.register_forward_hook(_skew_routing)


class RemoteAssignmentCounter:
    """Counts, from the routers' own outputs, (token, expert) assignments whose expert
    lives on another ep rank: the rows the dispatch must send. When the ep group spans
    `nodes` nodes, also the (token, node) pairs and the assignments on another node: what
    the two-stage dispatch sends across. Forwards only, not their replays under activation
    checkpointing (which route the same tokens again)."""

    def __init__(
        self, model: nn.Module, ep: int, ep_rank: int, num_experts: int, nodes: int = 1
    ) -> None:
        self.remote = self.remote_pairs = self.remote_node_assignments = 0
        for module in model.modules():
            if isinstance(module, ROUTERS):
                module.register_forward_hook(self._hook)
        self._local, self._per_node = num_experts // ep, num_experts // nodes
        self._rank, self._node = ep_rank, ep_rank // (ep // nodes)

    def _hook(self, _router, _inputs, out) -> None:
        if is_replay():
            return
        experts = out.top_experts  # [T, k]
        self.remote += int((experts // self._local != self._rank).sum())
        node = experts // self._per_node
        self.remote_node_assignments += int((node != self._node).sum())
        for token_nodes in node.tolist():
            self.remote_pairs += len(set(token_nodes) - {self._node})


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def stepped_records(trainer, steps: int):
    """Run `steps` steps through `trainer.train_step` (its record is what metrics.jsonl
    gets) and yield each record with the gradients the optimizer stepped with (clipped:
    captured by a post-step hook, since fused AdamW clips them inside its kernel and writes
    them back) and the updated parameters, as full tensors."""
    seen = {}
    trainer.optimizer.register_step_post_hook(
        lambda *_: seen.update(
            grads={n: _full(q.grad) for n, q in trainer.model.named_parameters() if q.requires_grad}
        )
    )
    # The parameters the optimizer holds (state and updates): the adapters alone under LoRA.
    names = {id(q): n for n, q in trainer.model.named_parameters()}
    optimized = sorted(names[id(q)] for g in trainer.optimizer.param_groups for q in g["params"])
    for _ in range(steps):
        out = trainer.steps.train_step(trainer.next_micro_batches())
        out["optimized"] = optimized
        out["grads"] = seen["grads"]
        out["params"] = {n: _full(q) for n, q in trainer.model.named_parameters()}
        yield out


def build_trainer(argv: list[str], world: int):
    """(config, Trainer) of `argv` on this rank of `world`, as train.py builds them."""
    from moetrain.loop.preflight import preflight
    from moetrain.loop.trainer import Trainer

    cfg = load_config(argv)
    p = cfg.parallel
    dims = ParallelDims.of(p, world)
    corpora = preflight(cfg, dims)
    return cfg, Trainer(cfg, dims, corpora)


def layout_worker(
    rank: int, world: int, argv: list[str], out_path: str, routing: str | None, steps: int = STEPS
):
    cfg, trainer = build_trainer(argv, world)
    dims = trainer.dims
    install_routing(trainer.model, routing)
    counter = None
    if dims.ep > 1:
        ep_rank = trainer.meshes.ep.get_local_rank()
        counter = RemoteAssignmentCounter(
            trainer.model, dims.ep, ep_rank, num_experts_of(cfg.model.args), dims.ep_nodes
        )
    records = []
    for out in stepped_records(trainer, steps):
        out["buffers"] = {n: b.clone() for n, b in trainer.model.named_buffers()}
        if trainer.bias_update is not None and trainer.bias_update.last_load is not None:
            # the routers' counts over the world that the bias update used, [L, E]
            out["bias_load"] = trainer.bias_update.last_load.clone()
        # ring attention's point-to-point operations so far (this rank)
        out["p2p_ops"] = sum(ring.stats.p2p_ops for ring in trainer.parallel.ring_attention)
        if counter is not None:
            # Per MoE layer and step: dispatch + combine, forward + backward, fp32 rows; and
            # each remote assignment's routing weight (fp32) out, its gradient back.
            row = cfg.model.args.hidden_size * 4
            out["a2a_expected"] = 4 * counter.remote * row + 8 * counter.remote
            if dims.ep_nodes > 1:
                # Each (token, remote node) row: out and back, forward and backward; each
                # remote assignment's routing: expert and row (int32 x 2) and weight (fp32)
                # out, the weight's gradient back.
                pairs, assignments = counter.remote_pairs, counter.remote_node_assignments
                out["a2a_internode_expected"] = 4 * pairs * row + 16 * assignments
                out["a2a_internode_forward"] = 2 * pairs * row + 12 * assignments
            counter.remote = counter.remote_pairs = counter.remote_node_assignments = 0
        records.append(out)
    if dims.pp > 1:  # each rank holds its stages' tensors: the union is the model
        merge_stages(records, world)
    gathered = [None] * world
    dist.all_gather_object(
        gathered,
        [
            {k: r.get(k) for k in ("a2a_bytes", "a2a_expected", "p2p_ops")}
            | {
                k: r.get(k)
                for k in ("a2a_internode_bytes", "a2a_internode_expected", "a2a_internode_forward")
            }  # fmt: skip
            for r in records
        ],
    )
    if rank == 0:
        torch.save({"records": records, "per_rank": gathered}, out_path)


def merge_stages(
    records: list[dict], world: int, keys: tuple[str, ...] = ("grads", "params", "buffers")
) -> None:
    """Every record's per-tensor dicts `keys` and names, merged over the ranks (pipeline
    stages)."""
    for record in records:
        parts = [None] * world
        dist.all_gather_object(parts, {k: record[k] for k in (*keys, "optimized")})
        for k in keys:
            record[k] = {n: t for part in parts for n, t in part[k].items()}
        record["optimized"] = sorted({n for part in parts for n in part["optimized"]})


def reference_run(
    argv: list[str],
    dp_size: int,
    routing: str | None = None,
    steps: int = STEPS,
    restart_from: list[dict] | None = None,
) -> list[dict]:
    """The same training on one process, written without any of the parallel code.

    With moe.aux_loss_mode=global_batch, the aux loss of accumulation round a is computed on
    the union of round a's micro-batches of all `dp_size` ranks, in one forward.
    `restart_from`: the compared run's records; each step after the first starts from its
    parameters and buffers of the step before (the optimizer's moments stay the
    reference's own). What FP8 rows need: FP8 rounding is discontinuous, so weights that
    differ in their last bit (a layout's reductions sum in another order) round some later
    element to the next FP8 value, and two runs drift apart step by step (1-ulp noise on
    the weights moves a tiny model's FP8 gradients by up to 1.6e-2, 1.3e-6 without FP8).
    """
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    model = spec.build(cfg.model.args, MoEOptions(z_loss=True))  # z-loss gradients always
    if cfg.peft.method == "lora":
        apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
    if cfg.train.fp8 != "none":  # the same FP8 forms, one process: no amax to reduce
        apply_float8(model, spec.plan, cfg.train.fp8, cfg.model.name)
    model.init_weights(cfg.train.seed)
    if cfg.peft.method == "lora":
        init_adapters(model, cfg.train.seed)
    install_routing(model, routing)
    # foreach, whatever the row's train.optimizer_impl: every row's fused (the default)
    # update is checked against it
    opt = build_optimizer(model, replace(cfg.train, optimizer_impl="foreach"))
    # torch's own scheduler, driven by the same formula (the trainer sets lr per step itself)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg.train))
    t, args = cfg.train, cfg.model.args
    num_experts, mtp_depth = num_experts_of(args), getattr(args, "num_nextn_predict_layers", 0)
    dataset = build_dataset(cfg.data, build_tokenizer(cfg.data))
    sampler = iter(
        GlobalBatchSampler(
            len(dataset), t.global_batch_size, t.micro_batch_size, 0, 1, t.seed, True
        )
    )
    n_micro = t.global_batch_size // t.micro_batch_size
    rounds = n_micro // dp_size
    records = []
    for step in range(steps):
        if restart_from is not None and step > 0:
            _load_state(model, restart_from[step - 1])
        micro = [[dataset[i] for i in next(sampler)] for _ in range(n_micro)]
        if cfg.moe.aux_loss_mode == "global_batch":  # rank r's round a is micro[r * rounds + a]
            forwards = [
                sum((micro[r * rounds + a] for r in range(dp_size)), []) for a in range(rounds)
            ]
        else:
            forwards = micro
        forwards = [Batch.stack(fw) for fw in forwards]
        if mtp_depth:
            forwards = [with_mtp_targets(fw, mtp_depth) for fw in forwards]
            n_mtp = sum((fw.mtp_labels != IGNORE_INDEX).sum((0, 1)) for fw in forwards)  # [D]
        n_tokens = sum((fw.labels != IGNORE_INDEX).sum() for fw in forwards)
        n_routed = sum(fw.input_ids.numel() for fw in forwards)  # every token meets the routers
        total_ce, total_aux, total_mtp, total_z = 0.0, 0.0, 0.0, 0.0
        for fw in forwards:
            inputs = {"mtp_input_ids": fw.mtp_input_ids} if mtp_depth else {}
            if cfg.data.document_mask:
                inputs["document_ids"] = fw.document_ids
            out = model(fw.input_ids, fw.position_ids, **inputs)
            ce = F.cross_entropy(out.logits.flatten(0, 1), fw.labels.flatten(), reduction="sum")
            stats, pooled = out.router_stats, cfg.moe.aux_loss_layers == "pooled"
            if cfg.moe.aux_loss_mode == "sequence":  # mean over all sequences of the batch
                aux = sequence_balance_loss(stats, pooled=pooled)
                aux = aux * len(forwards) / t.global_batch_size
            else:
                aux = load_balancing_loss(stats, num_experts, pooled=pooled)
            # ST-MoE's z-loss: mean over the batch's tokens and the layers of lse(logits)^2
            z = stats.z_sum.sum() / (len(stats.z_sum) * n_routed)
            loss = ce / n_tokens + args.router_aux_loss_coef * aux / len(forwards)
            loss = loss + cfg.moe.z_loss_coef * z
            for k, logits in enumerate(out.mtp_logits or []):
                labels = fw.mtp_labels[..., k].flatten()
                mtp = F.cross_entropy(logits.flatten(0, 1), labels, reduction="sum") / n_mtp[k]
                loss = loss + args.mtp_loss_weight / mtp_depth * mtp
                total_mtp += mtp.item() / mtp_depth
            loss.backward()
            total_ce, total_aux = total_ce + ce.item(), total_aux + aux.item()
            total_z += z.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        grads = {
            n: q.grad.detach().clone() for n, q in model.named_parameters() if q.requires_grad
        }  # clipped
        with torch.no_grad():  # aux-loss-free balancing, as the DeepSeek-V3 report writes it
            for router in model.modules():
                if isinstance(router, GroupLimitedRouter):
                    load = router.tokens_per_expert.float()
                    step = cfg.moe.bias_update_rate * torch.sign(load.mean() - load)
                    router.e_score_correction_bias += step
                    router.tokens_per_expert.zero_()
        opt.step()
        sched.step()
        opt.zero_grad()
        params = {n: q.detach().clone() for n, q in model.named_parameters()}
        records.append(
            {
                "loss": total_ce / n_tokens.item(),
                "aux_loss": total_aux / len(forwards),
                "z_loss": total_z,
                "grad_norm": norm.item(),
                "grads": grads,
                "params": params,
                "buffers": {n: b.clone() for n, b in model.named_buffers()},
                "mtp_loss": total_mtp if mtp_depth else None,
            }
        )
    return records


@torch.no_grad()
def _load_state(model: nn.Module, record: dict) -> None:
    """The parameters and buffers of a compared run's record, into `model`."""
    for name, param in model.named_parameters():
        param.copy_(record["params"][name])
    for name, buf in model.named_buffers():
        buf.copy_(record["buffers"][name])


def assert_tensors_close(ours: dict, ref: dict, what: str, rtol: float) -> None:
    assert ours.keys() == ref.keys()
    for name in ref:
        err = (ours[name] - ref[name]).norm() / ref[name].norm().clamp_min(1e-12)
        assert err <= rtol, f"{what} {name}: relative error {err:.2e} > {rtol}"


def assert_same_training(ours: list[dict], ref: list[dict], rtol: float = 1e-5) -> None:
    for step, (o, r) in enumerate(zip(ours, ref, strict=True), start=1):
        assert o["loss"] == pytest.approx(r["loss"], rel=rtol), f"loss at step {step}"
        assert o["aux_loss"] == pytest.approx(r["aux_loss"], rel=rtol), f"aux at step {step}"
        assert o["z_loss"] == pytest.approx(r["z_loss"], rel=rtol), f"z-loss at step {step}"
        assert o["grad_norm"] == pytest.approx(r["grad_norm"], rel=rtol), f"norm at step {step}"
        assert r["grad_norm"] > 0.5, "clipping should be active in this test"
        assert_tensors_close(o["grads"], r["grads"], f"step {step} grad", rtol)
        assert_tensors_close(o["params"], r["params"], f"step {step} param", rtol)
        if r["mtp_loss"] is None:
            assert o.get("mtp_loss") is None
        else:
            assert o["mtp_loss"] == pytest.approx(r["mtp_loss"], rel=rtol), f"mtp at step {step}"
        assert o["buffers"].keys() == r["buffers"].keys()
        for name, buf in r["buffers"].items():  # routing bias and counts: exactly equal
            assert torch.equal(o["buffers"][name], buf), f"step {step} buffer {name}"

"""DPO layouts against one plain process (the tests/parity.py machinery, for preference pairs).

The reference shares no code with moetrain/loop/preference.py: the policy is an unsharded
model (with LoRA, or trained whole under peft.method=none), the reference model a second,
separately built base (the same seed's weights, no adapters, frozen: what
`adapters_disabled` and the stored first pass must compute), each side's log-probability
summed (float64) in a Python loop over the sample's documents, DPO's sigmoid loss written out, the
aux and z losses of the policy's forwards as tests/parity.py adds them, RPO's term
(`dpo.nll_weight`) as the chosen answers' cross-entropy over the global batch's chosen
tokens, torch's own clipping and foreach AdamW, the global batch read through a one-rank
sampler, fp32; and the held-out pairs' figures sample by sample (`held_out_reference`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moetrain.build.lora import apply_lora, init_adapters
from moetrain.build.optimizer import build_optimizer, lr_factor
from moetrain.config import load_config
from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.data.conversations import PackedConversations
from moetrain.data.prepared import PreparedCorpus
from moetrain.data.sampler import GlobalBatchSampler
from moetrain.data.tokenizers import build_tokenizer
from moetrain.models import get_model_spec
from moetrain.models.common.balance_losses import load_balancing_loss
from moetrain.models.common.moe import MoEOptions
from tests.parity import build_trainer, merge_stages, num_experts_of, stepped_records

FIGURES = (
    "loss",
    "aux_loss",
    "z_loss",
    "grad_norm",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracy",
    "nll",
    "pairs",
)


def layouts_worker(rank: int, world: int, runs: list[list[str]], steps: int, out_path: str):
    """Each argv of `runs` trained for `steps` steps on these ranks, one after the other in
    this launch, then its held-out pairs evaluated; rank 0 saves their records (the last
    one the evaluation's). Under pipeline stages the tensors are merged over the ranks."""
    results = []
    for argv in runs:
        _, trainer = build_trainer(argv, world)
        records = []
        for out in stepped_records(trainer, steps):
            records.append({k: out[k] for k in (*FIGURES, "grads", "params", "optimized")})
        if trainer.dims.pp > 1:  # each rank holds its stages' tensors: the union is the model
            merge_stages(records, world, ("grads", "params"))
        records.append(trainer.evaluate())
        results.append(records)
        dist.barrier()
    if rank == 0:
        torch.save(results, out_path)


def _side_sums(logps: torch.Tensor, batch: Batch) -> list[tuple[list, list]]:
    """Per sample: (each document's log-probability sum, its trained-token count)."""
    out = []
    for b in range(batch.labels.shape[0]):
        trained = batch.labels[b] != IGNORE_INDEX
        docs = batch.document_ids[b]
        sums, counts = [], []
        last = int(docs[trained].max()) if trained.any() else -1  # padding after it
        for d in range(last + 1):
            where = (docs == d) & trained
            sums.append(logps[b][where].double().sum())
            counts.append(int(where.sum()))
        out.append((sums, counts))
    return out


def _pairs(policy: list, reference: list) -> list[tuple]:
    """(policy chosen, policy rejected, reference chosen, reference rejected, chosen tokens)
    of every pair: documents 2j and 2j + 1 of a sample, while 2j has trained tokens."""
    pairs = []
    for (p, n), (r, _) in zip(policy, reference, strict=True):
        for j in range(0, len(p) - 1, 2):
            if n[j]:
                pairs.append((p[j], p[j + 1], r[j], r[j + 1], n[j]))
    return pairs


def _logps(model, batch: Batch) -> tuple[torch.Tensor, object]:
    out = model(batch.input_ids, batch.position_ids, document_ids=batch.document_ids)
    logp = torch.log_softmax(out.logits.float(), -1)
    token = logp.gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0]
    return torch.where(batch.labels != IGNORE_INDEX, token, 0.0), out.router_stats


def held_out_reference(
    model, base, held: PackedConversations, samples: int, beta: float, nll_weight: float
) -> dict:
    """The evaluation's figures of the first `samples` held-out samples (DPO's sigmoid loss
    plus `nll_weight` times the chosen answers' mean cross-entropy), one sample at a time."""
    pairs, loss, chosen, rejected, tokens, nll = 0, 0.0, 0.0, 0.0, 0, 0.0
    with torch.no_grad():
        for i in range(samples):
            sample = held[i].map(lambda t: t[None])
            policy = _side_sums(_logps(model, sample)[0], sample)
            reference = _side_sums(_logps(base, sample)[0], sample)
            for pc, pr, rc, rr, n in _pairs(policy, reference):
                margin = float((pc - rc) - (pr - rr))
                loss -= float(F.logsigmoid(torch.tensor(beta * margin, dtype=torch.float64)))
                chosen += beta * float(pc - rc)
                rejected += beta * float(pr - rr)
                nll, tokens, pairs = nll - float(pc), tokens + n, pairs + 1
    return {
        "eval_pairs": pairs,
        "eval_loss": loss / pairs + nll_weight * nll / tokens,
        "eval_rewards/chosen": chosen / pairs,
        "eval_rewards/rejected": rejected / pairs,
        "eval_nll": nll / tokens,
    }


def dpo_reference_run(argv: list[str], steps: int) -> list[dict]:
    """`steps` records of the training, then (with eval.fraction) the held-out figures of
    the trained model."""
    cfg = load_config(argv)
    spec, args, t = get_model_spec(cfg.model.name), cfg.model.args, cfg.train
    model = spec.build(args, MoEOptions(z_loss=True))
    lora = cfg.peft.method == "lora"
    if lora:
        apply_lora(model, spec.plan, cfg.peft, cfg.model.name)
    model.init_weights(t.seed)
    if lora:
        init_adapters(model, t.seed)
    base = spec.build(args)
    base.init_weights(t.seed)
    opt = build_optimizer(model, replace(t, optimizer_impl="foreach"))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, t))
    corpus = PreparedCorpus.open(cfg.data.path)
    eos = build_tokenizer(cfg.data).eos_id
    fraction = cfg.eval.fraction
    dataset = PackedConversations(corpus, cfg.data.seq_len, eos, True, holdout=fraction)
    order = iter(
        GlobalBatchSampler(len(dataset), t.global_batch_size, t.micro_batch_size, 0, 1, t.seed)
    )
    forwards = t.global_batch_size // t.micro_batch_size
    beta, coef, nll_weight = cfg.dpo.beta, args.router_aux_loss_coef, cfg.dpo.nll_weight
    records = []
    for _ in range(steps):
        micro = [Batch.stack([dataset[i] for i in next(order)]) for _ in range(forwards)]
        with torch.no_grad():
            refs = [_side_sums(_logps(base, mb)[0], mb) for mb in micro]
        routed = sum(mb.input_ids.numel() for mb in micro)
        every = [p for ref in refs for p in _pairs(ref, ref)]  # the global batch's pairs
        pairs, chosen_tokens = len(every), sum(p[4] for p in every)
        figures = dict.fromkeys(FIGURES, 0.0)
        for mb, ref in zip(micro, refs, strict=True):
            logps, stats = _logps(model, mb)
            loss, nll = torch.zeros(()), torch.zeros(())
            for pc, pr, rc, rr, _ in _pairs(_side_sums(logps, mb), ref):
                margin = (pc - rc) - (pr - rr)
                loss = loss - F.logsigmoid(beta * margin)
                nll = nll - pc
                figures["rewards/chosen"] += beta * float(pc.detach() - rc)
                figures["rewards/rejected"] += beta * float(pr.detach() - rr)
                figures["rewards/accuracy"] += float(pc - rc > pr - rr)
            figures["loss"] += float(loss.detach())
            figures["nll"] += float(nll.detach())
            aux = load_balancing_loss(stats, num_experts_of(args))
            z = stats.z_sum.sum() / (len(stats.z_sum) * routed)
            share = loss / pairs + nll_weight * nll / chosen_tokens
            (share + coef * aux / forwards + cfg.moe.z_loss_coef * z).backward()
            figures["aux_loss"] += float(aux) / forwards
            figures["z_loss"] += float(z)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.requires_grad}
        opt.step()
        sched.step()
        opt.zero_grad()
        for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy"):
            figures[key] /= pairs
        figures["nll"] /= chosen_tokens
        figures["loss"] += nll_weight * figures["nll"]
        figures.update(grad_norm=float(norm), pairs=pairs)
        params = {n: q.detach().clone() for n, q in model.named_parameters()}
        records.append({**figures, "grads": grads, "params": params})
    if fraction is not None:
        held = PackedConversations(
            corpus, cfg.data.seq_len, eos, True, holdout=fraction, evaluation=True
        )
        records.append(held_out_reference(model, base, held, cfg.eval.samples, beta, nll_weight))
    return records

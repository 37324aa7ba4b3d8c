"""The training objective: `train.objective` (sft: next-token cross-entropy over the trained
tokens; dpo: preference pairs) and the `[dpo]` section (the rules that relate them to the
rest of the config: `objective_checks.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg

OBJECTIVES = ("sft", "dpo")
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
DPO_REFERENCES = ("auto", "base", "stored", "copy")


@dataclass
class DpoSection:
    beta: float = arg(
        0.1,
        "how far the policy may move from the reference: the implicit reward of an answer is "
        "beta * (its log-probability under the policy - under the reference)",
        gt=0,
    )
    loss: str = arg(
        "sigmoid",
        "sigmoid (DPO: -log sigmoid(beta * margin)) | ipo ((margin - 1 / (2 beta))^2 on the "
        "log-probabilities averaged over each answer's tokens) | hinge (relu(1 - beta * "
        "margin), SLiC); margin: the chosen answer's log-ratio minus the rejected one's",
        choices=DPO_LOSSES,
    )
    label_smoothing: float = arg(
        0.0,
        "loss=sigmoid: the probability that a pair's preference is flipped (conservative DPO: "
        "(1 - e) * the loss of the pair + e * the loss of the flipped pair) (0 = off)",
        ge=0,
        lt=0.5,
        note="0 = off",
    )
    nll_weight: float = arg(
        0.0,
        "weight of the chosen answers' mean next-token cross-entropy added to the loss (RPO; "
        "the mean over the global batch's chosen tokens) (0 = off)",
        ge=0,
        note="0 = off",
    )
    reference: str = arg(
        "auto",
        "where the reference log-probabilities come from: base (the frozen base of "
        "peft.method=lora, its adapters off: no second copy) | stored (computed once by a "
        "first pass of the initial model over the pairs, kept in job.output_dir) | copy (a "
        "second, frozen copy of the initial model, resident beside the policy) | auto (base "
        "with LoRA, else stored)",
        choices=DPO_REFERENCES,
    )

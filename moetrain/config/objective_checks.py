"""What `train.objective=dpo` does not combine with (yet), refused by key, and `[dpo]` keys
set while the objective does not read them."""

from __future__ import annotations

from dataclasses import fields

from moetrain.config.objective import DpoSection
from moetrain.config.schema import JobConfig


def dpo_reference(cfg: JobConfig) -> str:
    """`dpo.reference` as a run uses it: `auto` is the frozen base under LoRA, else stored."""
    if cfg.dpo.reference == "auto":
        return "base" if cfg.peft.method == "lora" else "stored"
    return cfg.dpo.reference


def objective_problems(cfg: JobConfig) -> list[str]:
    """What `train.objective` does not combine with, each naming the key and the fix."""
    d = cfg.dpo
    if cfg.train.objective != "dpo":
        changed = [f.name for f in fields(d) if getattr(d, f.name) != getattr(DpoSection(), f.name)]
        return [
            f"dpo.{name} is set, but train.objective={cfg.train.objective} does not read it; "
            "set train.objective=dpo or remove the key"
            for name in changed
        ]
    problems = []
    if d.label_smoothing and d.loss != "sigmoid":
        problems.append(
            f"dpo.label_smoothing={d.label_smoothing} smooths the sigmoid loss, but "
            f"dpo.loss={d.loss}; set dpo.loss=sigmoid or dpo.label_smoothing=0"
        )
    p = cfg.parallel
    lora, reference = cfg.peft.method == "lora", dpo_reference(cfg)
    if reference == "base" and not lora:
        problems.append(
            "dpo.reference=base is the frozen base under LoRA's adapters, but "
            f"peft.method={cfg.peft.method}; set peft.method=lora, or dpo.reference=stored"
        )
    elif reference != "base" and lora:
        problems.append(
            f"dpo.reference={reference} with peft.method=lora: the frozen base under the "
            "adapters is the initial model already (no pass, no second copy); set "
            "dpo.reference=base or leave it auto"
        )
    if reference in ("stored", "copy"):
        what = "the first pass's sums" if reference == "stored" else "the copy's forwards"
        for key, size in (("parallel.cp", p.cp), ("parallel.pp", p.pp)):
            if size > 1:
                problems.append(
                    f"{key}={size} with dpo.reference={reference} is not done yet ({what} "
                    f"over the {key.split('.')[1]} ranks); set {key}=1"
                )
    if cfg.peft.init_from:
        problems.append(
            "peft.init_from with train.objective=dpo: the reference is the frozen base with "
            "its adapters off, not the base with the adapters it starts from; merge those "
            "adapters into the weights first (python -m moetrain.export), then start from the "
            "merged model (model.init_from_hf)"
        )
    data = cfg.data
    if data.source != "tokens":
        problems.append(
            f"train.objective=dpo trains on preference pairs, but data.source={data.source}; "
            "prepare them with `python -m moetrain.prepare --format preference` and set "
            "data.source=tokens"
        )
    if data.document_mask is False or data.reset_positions is False:
        key = "data.document_mask" if data.document_mask is False else "data.reset_positions"
        problems.append(
            f"{key}=false with train.objective=dpo: each side's log-probability must not "
            "depend on the documents packed beside it (it would see the other side of its "
            f"pair); set {key}=true or leave it unset"
        )
    if data.mix or cfg.eval.mix:
        key = "data.mix" if data.mix else "eval.mix"
        problems.append(
            f"[[{key}]] with train.objective=dpo is not done yet (a blend of preference "
            f"corpora); give one prepared preference corpus as {key.split('.')[0]}.path"
        )
    return problems

"""Value checks of a typed JobConfig: the values no run can use, as one list of messages.

Single-field ranges and choices are not written here: they are the fields' metadata
(`models.common.args.arg`), checked by `field_problems` for the job sections and the
model's hyper-parameters alike. What is left is what relates two or more fields.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from models.common.args import field_problems
from parallelisms.dims import LayoutError, grad_accum_steps
from trainer.config.schema import JobConfig

# data.source values that read from data.path, and what the path names for each.
NEEDS_PATH = {
    "tokens": "a directory written by `python -m trainer.prepare --out DIR`",
    "text": "a glob of text files",
    "jsonl": "a glob of JSON-lines files",
    "hf_datasets": "a dataset name or directory",
}


def config_problems(cfg: JobConfig) -> list[str]:
    """Every impossible value in `cfg`, each message naming the key(s) and the fix."""
    problems: list[str] = []
    for f in fields(cfg):
        problems += field_problems(getattr(cfg, f.name), f.name)
    args = cfg.model.args
    arg_problems = field_problems(args, "model") if is_dataclass(args) else []
    problems += arg_problems
    # The model's cross-field checks (models/spec.py) may assume every field is in range
    # (e.g. divide by a head count), so they run only once the fields are.
    if not arg_problems and hasattr(args, "validate"):
        problems += args.validate()
    return problems + _cross_field_problems(cfg)


def _cross_field_problems(cfg: JobConfig) -> list[str]:
    t, d, p = cfg.train, cfg.data, cfg.parallel
    problems: list[str] = []

    def need(ok: bool, problem: str) -> None:
        if not ok:
            problems.append(problem)

    pieces = 2 * p.cp if p.cp_layout == "zigzag" else p.cp
    need(
        p.cp < 1 or d.seq_len % pieces == 0,  # cp < 1 is already reported by its bound
        f"data.seq_len ({d.seq_len}) must be divisible by {pieces} to split it over "
        f"parallel.cp={p.cp} ranks ({p.cp_layout} layout); change data.seq_len or parallel.cp",
    )
    if t.micro_batch_size >= 1 and t.global_batch_size >= 1:
        try:  # the layout's owner of batch arithmetic, with one data-parallel rank
            grad_accum_steps(t.global_batch_size, t.micro_batch_size, dp_size=1)
        except LayoutError as err:
            problems.append(str(err))
    need(
        d.source in NEEDS_PATH or d.path is None,
        f"data.path={d.path!r} is set, but data.source='{d.source}' does not read it (it would "
        "train on something else); set data.source to tokens, jsonl, text or hf_datasets, or "
        "remove data.path",
    )
    need(
        d.source not in NEEDS_PATH or bool(d.path),
        f"data.path is required when data.source = '{d.source}' (set it to "
        f"{NEEDS_PATH.get(d.source)})",
    )
    need(
        not (d.document_mask and p.cp > 1 and p.cp_kernel == "cpu_flash"),
        "parallel.cp_kernel=cpu_flash cannot apply document masks (data.document_mask=true): "
        "the CPU flash op takes no mask; use parallel.cp_kernel=auto (picks the masked math "
        "kernel) or math",
    )
    need(
        not (t.compile and t.activation_checkpoint == "selective"),
        "train.compile=true cannot compile under train.activation_checkpoint=selective (its "
        "keep/reuse dispatch modes make torch.compile run the blocks eagerly); use "
        "activation_checkpoint=full or none with compile, or set train.compile=false",
    )
    prof = cfg.profile.steps
    need(
        not prof or (len(prof) == 2 and prof[0] <= prof[1] <= t.steps),
        f"profile.steps={prof} must be [first, last] with first <= last <= train.steps "
        f"({t.steps}), e.g. profile.steps=[3, 5] (or [] for no profiling)",
    )
    need(
        p.dp_shard == -1 or p.dp_shard >= 1,
        f"parallel.dp_shard must be -1 (all remaining ranks) or >= 1, got {p.dp_shard}",
    )
    return problems

"""Value checks of a typed JobConfig: the values no run can use, as one list of messages.

Single-field ranges and choices are not written here: they are the fields' metadata
(`moetrain.models.common.args.arg`), checked by `field_problems` for the job sections and the
model's hyper-parameters alike. What is left is what relates two or more fields.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from importlib.metadata import version

from moetrain.config.objective_checks import objective_problems
from moetrain.config.schema import JobConfig
from moetrain.models.common.args import field_problems
from moetrain.parallelisms.dims import (
    CP_CHUNKS_PER_RANK,
    V_SCHEDULES,
    LayoutError,
    grad_accum_steps,
    stages_per_rank,
)

# data.source values that read from data.path, and what the path names for each.
NEEDS_PATH = {
    "tokens": "a directory written by `python -m moetrain.prepare --out DIR`",
    "text": "a glob of text files",
    "jsonl": "a glob of JSON-lines files",
    "hf_datasets": "a dataset name or directory",
}


UNMASKED_KERNELS = ("cpu_flash", "sdpa_flash", "sdpa_cudnn", "flash_attn")  # rings: no mask


def config_problems(cfg: JobConfig) -> list[str]:
    """Every impossible value in `cfg`, each message naming the key(s) and the fix."""
    problems: list[str] = []
    for f in fields(cfg):
        problems += field_problems(getattr(cfg, f.name), f.name)
    for section in (cfg.data, cfg.eval):  # the tables of [[data.mix]] and [[eval.mix]]
        where = "data" if section is cfg.data else "eval"
        for i, table in enumerate(section.mix, start=1):
            problems += field_problems(table, f"{where}.mix[{i}]")
    args = cfg.model.args
    arg_problems = field_problems(args, "model") if is_dataclass(args) else []
    problems += arg_problems
    # The model's cross-field checks (moetrain/models/spec.py) may assume every field is in range
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

    # The chunks a layout cuts each sequence into; at cp=1 nothing is cut (the batch
    # preparer splits only when cp > 1), so any length the model takes is fine.
    chunks = {"zigzag": 2 * p.cp, "balanced": CP_CHUNKS_PER_RANK * p.cp}.get(p.cp_layout, p.cp)
    pieces = chunks if p.cp > 1 else 1
    need(
        p.cp_layout != "balanced" or d.document_mask is not False,
        "parallel.cp_layout=balanced lays each micro-batch out by its documents' work, so it "
        "needs data.document_mask (true, or unset for masked shards); without documents "
        "use zigzag, which already balances the causal mask",
    )
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
    problems += _mix_problems(cfg)
    need(
        d.source in NEEDS_PATH or d.path is None,
        f"data.path={d.path!r} is set, but data.source='{d.source}' does not read it (it would "
        "train on something else); set data.source to tokens, jsonl, text or hf_datasets, or "
        "remove data.path",
    )
    need(
        d.source not in NEEDS_PATH or bool(d.path) or bool(d.mix),
        f"data.path is required when data.source = '{d.source}' (set it to "
        f"{NEEDS_PATH.get(d.source)})",
    )
    need(
        not (d.document_mask and p.cp > 1 and p.cp_kernel in UNMASKED_KERNELS),
        f"parallel.cp_kernel={p.cp_kernel} cannot apply document masks "
        f"(data.document_mask=true) in the ring of parallel.cp={p.cp}: the op takes no mask "
        "there; use parallel.cp_kernel=auto (flex "
        "on CUDA, the masked math kernel on CPU), flex, sdpa_efficient or math",
    )
    need(
        not (t.compile and t.activation_checkpoint == "selective"),
        "train.compile=true cannot compile under train.activation_checkpoint=selective (its "
        "recomputed regions swap autograd's saved tensors through hooks, which dynamo does "
        "not trace); use activation_checkpoint=full or none with compile, or set "
        "train.compile=false",
    )
    need(
        not (
            t.activation_checkpoint == "selective"
            and cfg.peft.method == "lora"
            and cfg.peft.dropout > 0
        ),
        f"peft.dropout={cfg.peft.dropout} with train.activation_checkpoint=selective: a "
        "recomputed region (DeepSeek-V3's up-projections) would draw a new dropout mask when "
        "backward rebuilds it; set peft.dropout=0, or activation_checkpoint=full or none",
    )
    need(
        cfg.peft.method != "lora" or bool(cfg.peft.targets),
        "peft.method=lora with peft.targets=[] would train nothing: name what gets adapters "
        "(attention, experts, shared_experts), or set peft.method=none",
    )
    need(
        cfg.peft.base_dtype == "fp32" or cfg.peft.method == "lora",
        f"peft.base_dtype={cfg.peft.base_dtype} needs peft.method=lora (only a frozen base "
        "can be held in bf16: trained weights keep fp32 masters); set peft.method=lora or "
        "peft.base_dtype=fp32",
    )
    need(
        cfg.peft.init_from is None or cfg.peft.method == "lora",
        "peft.init_from needs peft.method=lora (it holds LoRA adapters to start from)",
    )
    need(
        cfg.peft.init_from is None or not cfg.checkpoint.init_from,
        "peft.init_from and checkpoint.init_from both give this run's adapters: keep one "
        "(a stage takes the checkpoint's adapters)",
    )
    prof = cfg.profile.steps
    need(
        not prof or (len(prof) == 2 and prof[0] <= prof[1] <= t.steps),
        f"profile.steps={prof} must be [first, last] with first <= last <= train.steps "
        f"({t.steps}), e.g. profile.steps={profile_example(t.steps)} (or [] for no profiling)",
    )
    inject, count = cfg.debug.inject_nonfinite_step, cfg.debug.inject_nonfinite_count
    need(
        inject <= t.steps,
        f"debug.inject_nonfinite_step={inject} is past the run's last step (train.steps="
        f"{t.steps}): no step would be made non-finite; set it to a step in 1..{t.steps}, "
        "or 0 (off)",
    )
    last_injected = inject + count - 1
    need(
        not 0 < inject <= t.steps < last_injected,
        f"debug.inject_nonfinite_count={count} from debug.inject_nonfinite_step={inject} "
        f"reaches step {last_injected}, past the run's last step (train.steps={t.steps}): "
        f"{last_injected - t.steps} of its injections would never happen; set "
        f"debug.inject_nonfinite_count={t.steps - inject + 1} or less, or raise train.steps",
    )
    problems += _fp8_problems(cfg)
    problems += _pipeline_problems(cfg)
    problems += objective_problems(cfg)
    need(
        p.ep_overlap != "chunks" or p.ep > 1,
        "parallel.ep_overlap=chunks splits each MoE layer's tokens to overlap the expert "
        "all-to-all, and parallel.ep=1 has none; set parallel.ep > 1, or ep_overlap=shared",
    )
    need(
        p.dp_shard == -1 or p.dp_shard >= 1,
        f"parallel.dp_shard must be -1 (all remaining ranks) or >= 1, got {p.dp_shard}",
    )
    return problems


def _fp8_problems(cfg: JobConfig) -> list[str]:
    """What train.fp8 does not combine with (the device and torch: preflight)."""
    fp8, p = cfg.train.fp8, cfg.parallel
    if fp8 == "none":
        return []
    problems = []
    if cfg.peft.method == "lora":
        problems.append(
            f"train.fp8={fp8} with peft.method=lora: the adapted layers have no FP8 form (a "
            "frozen base gains little from FP8 GEMMs); set train.fp8=none or peft.method=none"
        )
    if fp8 == "tensorwise" and p.cp > 1 and cfg.train.activation_checkpoint == "selective":
        problems.append(
            f"train.fp8=tensorwise with parallel.cp={p.cp} reduces each activation's amax over "
            "the cp ranks (a collective), and train.activation_checkpoint=selective rebuilds "
            "projections in regions that may hold none (either backward pass may rebuild "
            "them); use train.fp8=rowwise (no collective), or activation_checkpoint=full or "
            "none"
        )
    return problems


def profile_example(steps: int) -> str:
    """A valid `profile.steps` for a run of `steps` steps, written as the CLI takes it (no
    space: one shell word): up to 3 steps from step 3, past the first steps' warm-up (memory
    allocation, compilation) that would crowd the trace."""
    last = max(steps, 1)  # train.steps < 1 is reported by its own bound
    first = min(3, last)
    return f"[{first},{min(first + 2, last)}]"


def _mix_problems(cfg: JobConfig) -> list[str]:
    """[[data.mix]], and the held-out data of [eval]."""
    d, e = cfg.data, cfg.eval
    problems = []
    if d.mix and d.path:
        problems.append(
            "data.path and [[data.mix]] are both set: train on one corpus (data.path) or on "
            "a blend ([[data.mix]]), not both"
        )
    if d.mix and d.max_tokens is not None:
        problems.append(
            f"data.max_tokens={d.max_tokens} caps one corpus, but [[data.mix]] blends whole "
            "corpora by weight: remove data.max_tokens (data.max_tokens=none)"
        )
    if d.mix and d.source != "tokens":
        problems.append(
            f"[[data.mix]] blends prepared corpora, but data.source='{d.source}': set "
            "data.source = 'tokens' (prepare each corpus with `python -m moetrain.prepare`)"
        )
    for where, tables in (("data.mix", d.mix), ("eval.mix", e.mix)):
        names = [t.name or t.path.rstrip("/").rsplit("/", 1)[-1] for t in tables]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            problems.append(
                f"{where}: the name {twice[0]!r} is used by two tables; give each a "
                "distinct name = ..."
            )
        problems += [
            f"{where} (table {i}): path is required" for i, t in enumerate(tables, 1) if not t.path
        ]
    given = [
        k
        for k, v in (("eval.path", e.path), ("eval.mix", e.mix), ("eval.fraction", e.fraction))
        if v
    ]
    if len(given) > 1:
        problems.append(f"{' and '.join(given)} are all held-out data: set only one of them")
    # Only a set interval: its default, 0, evaluates at the end, when there is data.
    if e.interval > 0 and not given:
        problems.append(
            f"eval.interval={e.interval} evaluates on held-out data, but there is no held-out "
            "data: set eval.path, [[eval.mix]] or eval.fraction, or eval.interval=0"
        )
    if e.fraction is not None and d.mix:
        problems.append(
            "eval.fraction holds out documents of data.path, but the run trains on "
            "[[data.mix]]: give the held-out data as eval.path or [[eval.mix]]"
        )
    return problems


# The first torch whose ZBVZeroBubble matched one rank on every layout row (2.11 did not:
# tests/test_layout_parity.py's ZBV rows with EP or MTP; its DualPipeV rows did).
ZBV_EXACT_FROM = (2, 13)


def installed_torch() -> str:
    """The installed torch's version, read without importing torch (a refusal answers
    before torch is imported)."""
    return version("torch")


def torch_release() -> tuple[int, ...]:
    """The installed torch's release numbers: 2.11.0+cu130 -> (2, 11, 0)."""
    text = installed_torch().split("+")[0]
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def _pipeline_problems(cfg: JobConfig) -> list[str]:
    """What parallel.pp does not combine with yet, and pp_layers' length."""
    p, t = cfg.parallel, cfg.train
    if p.pp == 1:
        return [
            f"parallel.{key} is set but parallel.pp=1 runs no pipeline; remove it or set "
            "parallel.pp"
            for key, unset in (("pp_layers", not p.pp_layers),)
            if not unset
        ]
    problems = []
    stages = p.pp * stages_per_rank(p.pp_schedule, p.pp_virtual_stages)
    if p.pp_layers and len(p.pp_layers) != stages:
        problems.append(
            f"parallel.pp_layers has {len(p.pp_layers)} entries, but parallel.pp={p.pp} with "
            f"pp_schedule={p.pp_schedule} runs {stages} stages; give one block count per stage"
        )
    if p.fsdp_gather == "step":
        problems.append(
            f"parallel.fsdp_gather=step is what parallel.pp={p.pp} already does (a stage "
            "gathers once per step and reduces its gradients once); remove the key"
        )
    for key, value, why in (
        ("parallel.cp_layout", p.cp_layout == "balanced", "balanced"),
        ("moe.aux_loss_layers", cfg.moe.aux_loss_layers == "pooled", "pooled"),
    ):
        if value:
            problems.append(
                f"{key}={why} does not run under parallel.pp={p.pp} yet (it needs every "
                "micro-batch or every layer in one place); use the default, or parallel.pp=1"
            )
    if t.activation_checkpoint == "full" and p.pp_schedule in V_SCHEDULES:
        problems.append(
            f"parallel.pp_schedule={p.pp_schedule} splits the backward in input and weight "
            "parts, and a block checkpointed in full cannot replay its forward for both (nor, "
            "with parallel.ep > 1 under DualPipeV, replay its all-to-alls in turn beside an "
            "overlapped forward); use train.activation_checkpoint=selective (recomputes norms, "
            "SwiGLU and the attention's inputs in either part) or none, or pp_schedule=1F1B / "
            "Interleaved1F1B"
        )
    if p.pp_schedule == "DualPipeV" and p.ep > 1 and p.cp > 1 and p.ep_overlap != "none":
        problems.append(
            "parallel.pp_schedule=DualPipeV with parallel.ep > 1 runs each overlapped forward "
            "and backward on two threads whose expert all-to-alls take turns, but ring "
            "attention's transfers (parallel.cp > 1) would run on both at once, out of order "
            "between ranks; set parallel.ep_overlap=none (the pairs run one after the other) "
            "or parallel.cp=1"
        )
    if p.pp_schedule == "ZBVZeroBubble" and torch_release() < ZBV_EXACT_FROM:
        exact = ".".join(map(str, ZBV_EXACT_FROM))
        problems.append(
            f"parallel.pp_schedule=ZBVZeroBubble does not train as one rank does on torch "
            f"{installed_torch()} (with expert parallelism or DeepSeek-V3's MTP the embedding's "
            f"gradient was 15% off); it is exact from torch {exact}: upgrade torch, or "
            "use pp_schedule=DualPipeV (the same V placement, exact on torch 2.11)"
        )
    if t.compile and p.pp_schedule in V_SCHEDULES:
        problems.append(
            f"parallel.pp_schedule={p.pp_schedule} splits the backward in input and weight "
            "parts, which torch.compile does not support; use train.compile=false or "
            "pp_schedule=1F1B / Interleaved1F1B"
        )
    return problems

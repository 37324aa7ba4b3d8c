"""The job configuration's schema: one dataclass per TOML section.

Every field is made with `moetrain.models.common.args.arg`, like the models' hyper-parameters:
a one-line doc that `train.py --help` prints, and the bounds or choices that
`moetrain.config.checks` enforces generically. Checks that relate two fields live in
`checks.py`. The `[model]` section holds `name`, `init_from_hf` and the chosen model's
own hyper-parameters (its dataclass from `moetrain.models.model_args_class`).
"""

from __future__ import annotations

import types
from dataclasses import Field, dataclass, field, fields
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

from moetrain.config.moe_peft import MoESection, PeftSection  # noqa: F401  (sections of JobConfig)
from moetrain.config.objective import OBJECTIVES, DpoSection
from moetrain.config.parallel_section import ParallelSection  # noqa: F401  (a section of JobConfig)
from moetrain.models.common.args import arg


@dataclass
class JobSection:
    name: str = arg("run", "run name, shown in logs")
    output_dir: str = arg("outputs/run", "where metrics.jsonl (and later checkpoints) are written")


@dataclass
class ModelSection:
    name: str = arg("qwen3_moe", "model family (see moetrain/models/__init__.py)")
    init_from_hf: str | None = arg(
        None, "Hugging Face model directory (config.json + safetensors) to start from"
    )
    # The chosen model's hyper-parameters (e.g. moetrain.models.qwen3_moe.args.Qwen3MoeArgs),
    # filled from the other keys of [model]; not a key itself, hence no `arg`.
    args: Any = None


@dataclass
class MixSource:
    """One `[[data.mix]]` (or `[[eval.mix]]`) table: a prepared corpus and its weight."""

    path: str = arg("", "a directory written by `python -m moetrain.prepare`")
    weight: float = arg(1.0, "its share of the blend (weights are normalised)", gt=0)
    name: str | None = arg(None, "its name in the console and metrics (default: the directory's)")


@dataclass
class DataSection:
    source: str = arg(
        "stdlib",
        "tokens (a directory of token shards from `python -m moetrain.prepare`, read by memory "
        "map: any corpus size) | in memory, for small corpora: stdlib (Python's own source "
        "files, no download) | text (glob of files) | jsonl (glob of JSON-lines files) | "
        "hf_datasets (datasets.load_dataset or load_from_disk)",
        choices=("stdlib", "text", "jsonl", "hf_datasets", "tokens"),
    )
    path: str | None = arg(
        None,
        "prepared directory (tokens), glob (text/jsonl), or dataset name/directory (hf_datasets)",
    )
    mix: list[MixSource] = arg(
        [],
        "[[data.mix]] tables (path, weight, name): prepared corpora blended by weight, "
        "instead of data.path (data.source=tokens); on the command line a TOML list, "
        "e.g. [{path='web', weight=0.7}, {path='code', weight=0.3}]",
    )
    text_field: str = arg("text", "field that holds the document text (jsonl, hf_datasets)")
    hf_split: str = arg("train", "split to read (hf_datasets)")
    tokenizer: str = arg(
        "byte", "byte (256 byte ids + EOS, vocab 257) or a path to a tokenizer.json"
    )
    eos_token: str | None = arg(
        None, "EOS token string of a tokenizer.json tokenizer (default: a common one it contains)"
    )
    seq_len: int = arg(
        256, "tokens per training sample (documents are packed with EOS separators)", ge=1
    )
    max_tokens: int | None = arg(
        None, "stop reading the source after this many tokens (None = read all of it)", gt=0
    )
    document_mask: bool | None = arg(
        None,
        "attend only within each packed document (causal inside it), not across EOS; none: on "
        "for prepared shards with a loss mask (instruction data), off otherwise",
    )
    reset_positions: bool | None = arg(
        None,
        "restart position ids (RoPE) at 0 for each packed document, after every EOS; none: on "
        "for prepared shards with a loss mask, off otherwise",
    )
    shuffle: bool = arg(True, "shuffle the sample order each epoch (seeded by train.seed)")
    num_workers: int = arg(0, "dataloader worker processes", ge=0)
    verify: str = arg(
        "size",
        "tokens: check the shards at start-up by size (truncation; instant) or by sha256 "
        "(reads every byte once); either way each 64 KiB block's CRC-32 is checked when first "
        "read and every id against model.vocab_size",
        choices=("size", "checksum"),
    )
    max_in_memory_mb: int = arg(
        1024,
        "the in-memory sources refuse a corpus larger than this many MB of text (every rank "
        "would hold ~4x it in RAM); prepare it once with `python -m moetrain.prepare` instead",
        ge=1,
    )


# Applied steps the spike rule needs before it judges, so the least train.skip_spike_window
# (why a smaller window is refused rather than judged once full: moetrain/loop/guard.py).
MIN_SPIKE_HISTORY = 10


@dataclass
class TrainSection:
    objective: str = arg(
        "sft",
        "sft (next-token cross-entropy over the trained tokens) | dpo (preference pairs of "
        "`prepare --format preference`: the [dpo] section)",
        choices=OBJECTIVES,
    )
    steps: int = arg(100, "optimizer steps to run", ge=1)
    seed: int = arg(0, "seed of weight init and data order (same seed -> same run on any layout)")
    global_batch_size: int = arg(
        8, "sequences per optimizer step, whatever the number of ranks", ge=1
    )
    micro_batch_size: int = arg(
        1, "sequences per rank per forward; grad accumulation = global / (micro * dp ranks)", ge=1
    )
    lr: float = arg(3e-4, "peak learning rate", gt=0)
    min_lr_ratio: float = arg(
        0.1, "final learning rate as a fraction of lr (cosine, wsd)", ge=0, le=1
    )
    schedule: str = arg(
        "cosine",
        "cosine (warmup then cosine decay) | wsd (warmup, stable, decay) | constant (after warmup)",
        choices=("cosine", "wsd", "constant"),
    )
    warmup_steps: int = arg(10, "linear warmup steps from 0 to lr", ge=0)
    decay_ratio: float = arg(
        0.2, "wsd: fraction of steps spent in the final linear decay", ge=0, le=1
    )
    weight_decay: float = arg(0.1, "AdamW decoupled weight decay (not applied to norms)", ge=0)
    beta1: float = arg(0.9, "AdamW beta1", ge=0, lt=1)
    beta2: float = arg(0.95, "AdamW beta2", ge=0, lt=1)
    eps: float = arg(1e-8, "AdamW epsilon", gt=0)
    optimizer_impl: str = arg(
        "fused",
        "AdamW's kernels: fused (one pass over each parameter; foreach where torch has no "
        "fused AdamW for the parameters' device and dtype, said at start-up) | foreach "
        "(torch's multi-tensor ops, several passes); checkpoints resume across the two",
        choices=("fused", "foreach"),
    )
    optimizer_state_dtype: str = arg(
        "fp32",
        "the dtype AdamW stores its moments (exp_avg, exp_avg_sq) in: fp32 | bf16 (half the "
        "optimizer state; each step widens them to fp32, one parameter at a time, and rounds "
        "back; not the fused kernel); a resume casts the checkpoint's moments to this dtype "
        "(noted at start-up)",
        choices=("fp32", "bf16"),
    )
    max_grad_norm: float = arg(
        1.0, "clip the global gradient L2 norm to this (0 = no clipping)", ge=0, note="0 = off"
    )
    mixed_precision: str = arg(
        "auto",
        "auto (bf16 params/compute with fp32 reduce on CUDA, fp32 on CPU) | bf16 | fp32",
        choices=("auto", "bf16", "fp32"),
    )
    device: str = arg(
        "auto", "auto (cuda if available) | cuda | cpu", choices=("auto", "cuda", "cpu")
    )
    fp8: str = arg(
        "none",
        "FP8 GEMMs with dynamic scaling for the attention projections, dense MLPs and the "
        "routed and shared experts (router, embeddings, norms and head stay in the compute "
        "dtype; weights and checkpoints stay in their master dtype): none | rowwise (a scale "
        "per row of each GEMM input, e4m3 forward and backward) | tensorwise (one scale per "
        "tensor, e4m3 forward, e5m2 gradients); needs CUDA compute capability 8.9+ (Hopper, "
        "Ada) or the CPU",
        choices=("none", "rowwise", "tensorwise"),
    )
    activation_checkpoint: str = arg(
        "none",
        "recompute blocks in backward to save memory: none | full (keep block inputs only) | "
        "selective (also keep matmul, attention and all-to-all outputs)",
        choices=("none", "full", "selective"),
    )
    compile: bool = arg(
        False,
        "torch.compile each block (regional, inductor on CPU and CUDA); the EP all-to-all "
        "hooks and the CP ring run eagerly (graph breaks); not with "
        "activation_checkpoint=selective",
    )
    max_skipped_steps: int = arg(
        5,
        "a step whose loss or grad norm is not finite (or spikes) is skipped: its batch is "
        "consumed, nothing else moves; this many consecutive skips save a checkpoint and stop "
        "the run (exit 3) (0 = never stop)",
        ge=0,
        note="0 = never stop",
    )
    skip_spike_sigma: float = arg(
        0.0,
        "also skip a step whose loss or grad norm exceeds the mean + S standard deviations of "
        "the last skip_spike_window applied steps (0 = off)",
        ge=0,
        note="0 = off",
    )
    skip_spike_window: int = arg(
        100,
        "applied steps the spike rule's mean and deviation are taken over; it judges once "
        f"{MIN_SPIKE_HISTORY} are in (with skip_spike_sigma > 0)",
        ge=MIN_SPIKE_HISTORY,
        note="a mean and deviation of fewer steps are noise; train.skip_spike_sigma=0 turns "
        "spike skipping off",
    )


@dataclass
class CheckpointSection:
    interval: int = arg(0, "save every N steps (0 = no checkpoints)", ge=0, note="0 = off")
    resume: str = arg("auto", "auto (newest complete checkpoint) | none | PATH")
    keep_last: int = arg(
        0, "keep only the newest K checkpoints (0 = keep all)", ge=0, note="0 = keep all"
    )
    async_save: bool = arg(False, "overlap the checkpoint write with training")
    save_frozen: bool = arg(
        False,
        "with peft.method=lora: checkpoints hold the frozen base too; off: the adapters and "
        "their optimizer state alone, the base coming back on resume and export from where "
        "the run took it (model.init_from_hf, or train.seed)",
    )
    allow_data_change: bool = arg(
        False,
        "resume even though the data differs from the checkpoint's (its content fingerprint: "
        "another corpus, tokenizer or data.max_tokens); off: such a resume is refused",
    )
    init_from: str | None = arg(
        None,
        "start a continuation (a new run) from this training checkpoint (a step-N directory, or a "
        "job.output_dir whose newest checkpoint is taken), of any layout: its weights, then "
        "this run's data, data.seq_len, schedule and steps from step 0. Used only while this "
        "job has no checkpoint of its own: a relaunch resumes the continuation",
    )
    init_optimizer: bool = arg(
        False,
        "with checkpoint.init_from: also take the optimizer's moments from it (this run's "
        "lr, betas and weight decay still apply); off: the optimizer starts fresh",
    )


@dataclass
class MetricsSection:
    log_interval: int = arg(1, "log every N steps to the console and metrics.jsonl", ge=1)
    jsonl: bool = arg(True, "append each logged step to <job.output_dir>/metrics.jsonl")
    expert_load_interval: int = arg(
        10,
        "every N steps, log tokens per expert of each MoE layer to metrics.jsonl (0 = never)",
        ge=0,
        note="0 = never",
    )
    progress: bool = arg(True, "show a progress bar with ETA on rank 0")
    tensorboard: bool = arg(
        False, "also write TensorBoard events under <job.output_dir>/tb/ (needs tensorboard)"
    )
    wandb: bool = arg(False, "also log to Weights & Biases (needs wandb)")
    wandb_project: str = arg("moetrain", "W&B project")
    wandb_run: str | None = arg(None, "W&B run name (default: job.name)")
    wandb_mode: str = arg(
        "online",
        "W&B mode: online | offline (no network; sync later)",
        choices=("online", "offline"),
    )


@dataclass
class EvalSection:
    interval: int = arg(
        0,
        "evaluate every N steps, and once at the end of training (0: only at the end); "
        "needs eval data: eval.path, eval.mix or eval.fraction",
        ge=0,
        note="0 = only at the end",
    )
    path: str | None = arg(
        None, "held-out data: a directory written by `python -m moetrain.prepare`"
    )
    mix: list[MixSource] = arg(
        [], "held-out data: [[eval.mix]] tables (path, weight, name), one loss per source"
    )
    fraction: float | None = arg(
        None,
        "held-out data: this fraction of the training corpus' documents (chosen by a hash of "
        "each document's index: the same for every layout and seed), removed from training",
        gt=0,
        lt=1,
    )
    samples: int = arg(
        64, "held-out sequences of data.seq_len evaluated each round (the same ones)", ge=1
    )
    micro_batch_size: int = arg(1, "sequences per rank per eval forward", ge=1)


@dataclass
class ProfileSection:
    steps: list[int] = arg(
        [],
        "[a, b]: record steps a..b (1-based) with torch.profiler on every rank into "
        "<job.output_dir>/profile/step-<a>-<b>/ (empty = off)",
        ge=1,
    )
    top: int = arg(20, "operators rank 0 prints by self time after the profiled steps", ge=0)


@dataclass
class DebugSection:
    inject_nonfinite_step: int = arg(
        0,
        "fault injection for tests: make the gradients of step N non-finite on every rank, "
        "so the bad-step guard skips it (0 = off)",
        ge=0,
        note="0 = off",
    )
    inject_nonfinite_count: int = arg(
        1, "with inject_nonfinite_step: inject into this many consecutive steps", ge=1
    )


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    moe: MoESection = field(default_factory=MoESection)
    peft: PeftSection = field(default_factory=PeftSection)
    dpo: DpoSection = field(default_factory=DpoSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    eval: EvalSection = field(default_factory=EvalSection)
    profile: ProfileSection = field(default_factory=ProfileSection)
    debug: DebugSection = field(default_factory=DebugSection)


# --- What loading and the help text need to know about the schema ----------------------

SECTIONS: dict[str, type] = get_type_hints(JobConfig)
# [model] keys that belong to ModelSection itself; every other key is a model hyper-parameter.
MODEL_OWN_KEYS = tuple(f.name for f in fields(ModelSection) if f.name != "args")


def key_fields(cls: type) -> list[Field]:
    """The fields of `cls` that are keys of its section (ModelSection.args is not one)."""
    return [f for f in fields(cls) if not (cls is ModelSection and f.name == "args")]


@cache
def field_types(cls: type) -> dict[str, Any]:
    # Annotations are strings (`from __future__ import annotations`); resolve them once.
    return get_type_hints(cls)


def type_name(tp: Any) -> str:
    """A field type as the help text and the error messages write it: `int | None`."""
    if get_origin(tp) in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(tp))
    if get_origin(tp) is list:
        return f"list[{type_name(get_args(tp)[0])}]"
    return "None" if tp is type(None) else getattr(tp, "__name__", str(tp))

"""Before the first step, before any process group exists: the checks that need more than
the config (the model on the meta device and its plan, the data, the checkpoint to resume
or continue from, the tokenizer). `train.py` runs `preflight`, so a bad run is refused
with one message and exit code 2 instead of a traceback on every rank.
"""

from __future__ import annotations

from dataclasses import fields

from moetrain.build.distributed import resolve_device
from moetrain.build.float8 import apply_float8, fp8_device_problem
from moetrain.build.model import compute_dtype, meta_model, pipeline_cut
from moetrain.checkpoint.continuation import (
    check_continuation,
    check_continuation_keys,
    check_stage_objective,
    resolve_continuation,
)
from moetrain.checkpoint.markers import check_checkpoint
from moetrain.checkpoint.resume import check_resume, resume_candidate
from moetrain.checkpoint.tokenizer_record import tokenizer_record
from moetrain.config import ConfigError, JobConfig, validate
from moetrain.data.corpus import check_corpus, check_objective, resolve_document_flags
from moetrain.data.prepared import Corpora
from moetrain.data.run_data import check_held_out
from moetrain.data.tokenizers import build_tokenizer
from moetrain.errors import DataError
from moetrain.metrics.sinks import check_sinks
from moetrain.models import get_model_spec
from moetrain.models.common.args import field_problems
from moetrain.models.spec import ModelSpec
from moetrain.parallelisms.attention_kernels import CUDA_ONLY
from moetrain.parallelisms.dims import LayoutError, ParallelDims, check_pipeline
from moetrain.parallelisms.flash_attn_support import (
    KEY,
    FlashAttnHost,
    FlashAttnUse,
    flash_attn_problems,
    probe_host,
    refusal,
)
from moetrain.parallelisms.parallelize import check_layout
from moetrain.parallelisms.plan import match_modules


def check_cp_kernel(kernel: str, device_type: str, cfg) -> None:
    """The ring's block kernel against the device and precision training runs in."""
    if kernel == "cpu_flash" and device_type != "cpu":
        raise LayoutError(
            "parallel.cp_kernel=cpu_flash runs on CPU only, but training runs on "
            f"{device_type}; use parallel.cp_kernel=auto or math"
        )
    if kernel in CUDA_ONLY and device_type != "cuda":
        raise LayoutError(
            f"parallel.cp_kernel={kernel} runs on CUDA only, but training runs on "
            f"{device_type}; use parallel.cp_kernel=auto or math"
        )
    if kernel in ("sdpa_flash", "sdpa_cudnn") and cfg.train.mixed_precision == "fp32":
        raise LayoutError(
            f"parallel.cp_kernel={kernel} computes in bf16 only, but "
            f"train.mixed_precision={cfg.train.mixed_precision}; set "
            "train.mixed_precision=bf16, or use parallel.cp_kernel=auto, sdpa_efficient or flex"
        )


def check_flash_attn(
    cfg: JobConfig, dims: ParallelDims, spec: ModelSpec, model, host: FlashAttnHost
) -> None:
    """`parallel.cp_kernel=flash_attn` against the machine (`host`), the dtype attention
    computes in and the model's attention (`model` on the meta device): as the ring's block
    kernel (cp > 1: no mask) and as the attention core (cp = 1) alike."""
    if spec.plan.attention_core is None:
        raise LayoutError(
            f"{KEY}: model {cfg.model.name!r}'s plan names no attention core to run it in; "
            "use parallel.cp_kernel=auto"
        )
    cores = match_modules(model, spec.plan.attention_core, "attention_core")
    windows = any(core.window is not None for _, core in cores)
    shape, args = spec.attention, cfg.model.args
    use = FlashAttnUse(
        compute_dtype(cfg.train, host.device_type),
        getattr(args, shape.qk_dim),
        getattr(args, shape.v_dim),
        sinks=shape.sinks and dims.cp == 1,  # the ring folds sinks in itself
        ring_masks=dims.cp > 1 and (windows or bool(cfg.data.document_mask)),
    )
    problems = flash_attn_problems(host, use)
    if problems:
        raise LayoutError(refusal(problems))


def check_fp8(cfg: JobConfig, dims: ParallelDims, spec, model, host: FlashAttnHost) -> None:
    """`train.fp8` against the model (its experts must have an FP8 form: refused by
    `apply_float8` on the meta model), the machine (`host`: its device type and CUDA
    capability) and the installed torch."""
    apply_float8(model, spec.plan, cfg.train.fp8, spec.name)
    device, capability = host.device_type, host.capability
    routed = match_modules(model, spec.plan.routed_experts or (), "routed_experts", False)
    problem = fp8_device_problem(
        cfg.train.fp8, device, capability, compute_dtype(cfg.train, device), bool(routed)
    )
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // max(dims.cp, 1)
    if not problem and device == "cuda" and cfg.train.fp8 == "tensorwise" and tokens % 16:
        problem = (
            f"train.fp8=tensorwise runs the weight gradient's GEMM over a rank's {tokens} "
            "tokens a micro-batch (train.micro_batch_size * data.seq_len / parallel.cp), "
            "which the CUDA FP8 kernel needs to be a multiple of 16; change those keys or "
            "use train.fp8=rowwise (its weight gradient runs in bf16)"
        )
    if problem:
        raise ConfigError(problem)


def resolve_model_args(cfg: JobConfig) -> None:
    """With model.init_from_hf, the architecture comes from the HF config.json.

    Keys set in the job config to something other than their default must agree with it:
    silently training a different shape than the user wrote would be worse than an error.
    The model's `training_fields` are training choices: always the job config's.
    """
    if not cfg.model.init_from_hf:
        return
    spec = get_model_spec(cfg.model.name)
    if spec.hf_adapter is None:
        raise ConfigError(
            f"model.init_from_hf is set, but model {cfg.model.name!r} has no Hugging Face "
            "adapter; remove the key"
        )
    hf_args = spec.hf_adapter.load_hf_config(cfg.model.init_from_hf)
    defaults = spec.args_cls()
    for f in fields(spec.args_cls):
        ours, theirs = getattr(cfg.model.args, f.name), getattr(hf_args, f.name)
        if f.name in spec.training_fields:
            setattr(hf_args, f.name, ours)
            continue
        if ours != getattr(defaults, f.name) and ours != theirs:
            raise LayoutError(
                f"model.{f.name}={ours!r} disagrees with {cfg.model.init_from_hf}/config.json "
                f"({theirs!r}); remove the key or make them equal"
            )
    # The HF values never went through the config's checks: a config.json the model cannot
    # take is refused here, not inside the model's constructor.
    problems = field_problems(hf_args, "model")
    if not problems and hasattr(hf_args, "validate"):
        problems = hf_args.validate()
    if problems:
        where = f"{cfg.model.init_from_hf}/config.json"
        raise ConfigError(f"{where} gives values this model cannot take: " + "; ".join(problems))
    cfg.model.args = hf_args


def preflight(cfg: JobConfig, dims: ParallelDims, planned: FlashAttnHost | None = None) -> Corpora:
    """Checks that need more than the config alone, before any process group exists.
    Returns the config's prepared corpora, each manifest read once, for the run's data.
    `planned`: the GPUs a plan is for (the planner, on a machine without them), against
    which the kernel choices (flash_attn, FP8) are judged; None: this machine, probed."""
    check_sinks(cfg)
    resolve_model_args(cfg)
    if cfg.checkpoint.resume not in ("auto", "none"):
        check_checkpoint(cfg.checkpoint.resume)
    check_continuation_keys(cfg)
    resume_from = resume_candidate(cfg)
    # A continuation starts from checkpoint.init_from only while its job has no checkpoint of its
    # own: a relaunch resumes the continuation, even once the checkpoint it started from is gone.
    continuation = resolve_continuation(cfg) if resume_from is None else None
    if dims.cp > 1:
        check_cp_kernel(cfg.parallel.cp_kernel, resolve_device(cfg.train.device).type, cfg)
    spec = get_model_spec(cfg.model.name)
    model = meta_model(spec, cfg.model.args, cfg.peft)  # a LoRA target it lacks: refused
    check_layout(model, spec.plan, dims)
    if cfg.parallel.cp_kernel == "flash_attn" or cfg.train.fp8 != "none":
        # The machine the kernels are judged on: the planned one, else this one.
        host = planned or probe_host(resolve_device(cfg.train.device))
        if cfg.parallel.cp_kernel == "flash_attn":
            check_flash_attn(cfg, dims, spec, model, host)
        if cfg.train.fp8 != "none":
            check_fp8(cfg, dims, spec, model, host)
    if dims.pp > 1:
        pipeline_cut(cfg, spec, model)  # refuses a bad cut
        check_pipeline(
            dims.pp,
            cfg.parallel.pp_schedule,
            cfg.parallel.pp_virtual_stages,
            dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size),
            cfg.train.global_batch_size,
            cfg.train.micro_batch_size,
        )
    if resume_from is not None:
        check_resume(resume_from, cfg, spec)
    if continuation is not None:
        check_continuation(continuation, cfg, model)
        check_stage_objective(continuation, cfg)
    dims.grad_accum(cfg.train.global_batch_size, cfg.train.micro_batch_size)
    tokenizer = build_tokenizer(cfg.data)
    vocab = cfg.model.args.vocab_size  # part of the contract (moetrain/models/spec.py)
    if tokenizer.vocab_size > vocab:
        raise DataError(
            f"tokenizer {cfg.data.tokenizer!r} has {tokenizer.vocab_size} tokens but the model's "
            f"vocab_size is {vocab}; raise model.vocab_size or use a smaller tokenizer"
        )
    limit = spec.max_positions(cfg.model.args) if spec.max_positions else None
    if limit is not None and cfg.data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is longer than the {limit} positions model "
            f"{cfg.model.name!r} is meant for (its [model] position limit); lower data.seq_len "
            "or raise the limit if the model really extends to it"
        )
    corpora = Corpora(cfg.data, cfg.eval)
    check_corpus(cfg.data, tokenizer, corpora)
    check_held_out(cfg.data, cfg.eval, tokenizer, corpora)
    check_objective(cfg.train.objective, corpora)
    if cfg.train.objective == "dpo" and spec.loss_terms(cfg.model.args).mtp_depth:
        raise ConfigError(
            f"train.objective=dpo with model {cfg.model.name!r}'s multi-token prediction: its "
            "loss would train the rejected answers' tokens too; set its depth to 0 for "
            "preference training (model.num_nextn_predict_layers=0)"
        )
    # A chat template changed since the data was rendered is refused here, on every rank:
    # the checkpoints record it for the export (moetrain.checkpoint.tokenizer_record).
    tokenizer_record(cfg, corpora)
    resolve_document_flags(cfg.data, corpora)
    validate(cfg)  # again: the rules that read the flags just resolved
    return corpora

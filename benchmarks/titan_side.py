"""torchtitan's side of benchmarks/vs_torchtitan.py: its Qwen3 MoE at our proxy's shapes,
trained with its own components at its defaults.

Needs torchtitan 0.2.2 importable. Its `Trainer` itself needs a tokenizer and a data set on
disk, so its step is restated here from 0.2.2's `Trainer.train_step` (non-pipelined path):
zero_grad, the global valid-token count, per micro-batch host-to-device copy, forward, loss
sum / global tokens, backward; clip (foreach), optimizer step; loss and norm read on the host
at its default `metrics.log_freq` (steps 1, 10, 20, ...). Its learning-rate scheduler is not
stepped: both sides train at one constant-enough rate, and a scheduler step costs no kernel.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
import types

import torch
from torch.distributed.device_mesh import init_device_mesh

# torchtitan's Qwen3ModelArgs field -> our key; its MoEArgs fields are set separately.
TITAN_NAMES = dict(n_layers="num_hidden_layers", dim="hidden_size", head_dim="head_dim",
                   n_heads="num_attention_heads", n_kv_heads="num_key_value_heads",
                   moe_inter_dim="moe_intermediate_size", vocab_size="vocab_size",
                   rope_theta="rope_theta", norm_eps="rms_norm_eps")  # fmt: skip


def import_torchtitan_qwen3():
    """torchtitan.models.qwen3 without the `datasets` package or triton: its __init__ imports the HF data
    loader, hence `datasets` and pyarrow (tens of MiB, too heavy to carry offline). No data set
    is loaded here, so a placeholder that raises if called stands in where it is missing."""
    try:
        import datasets  # noqa: F401
    except ImportError:

        def missing(*_args, **_kwargs):
            raise RuntimeError("the datasets package is not installed (vs_torchtitan.py)")

        stub, stub_dist = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.Dataset, stub.load_dataset = type("Dataset", (), {}), missing
        stub.distributed, stub_dist.split_dataset_by_node = stub_dist, missing
        sys.modules.update({"datasets": stub, "datasets.distributed": stub_dist})
    if importlib.util.find_spec("triton") is None:
        # NOTE: torch's CPU wheels come without triton (about 290 MB), which torchtitan's MoE
        # kernels module imports for one GPU kernel: the token padding of its grouped GEMM.
        # On CPU its experts loop instead (`use_grouped_mm=False`, build_torchtitan), and the
        # kernel is never called; a placeholder that raises if it were stands in for it.
        def gpu_only(*_args, **_kwargs):
            raise RuntimeError("torchtitan's grouped-GEMM padding is a Triton (GPU) kernel")

        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = gpu_only
        sys.modules.setdefault("torchtitan.models.moe.kernels", kernels)
    import torchtitan.models.qwen3 as qwen3

    return qwen3


def build_torchtitan(args, shapes: dict, device: torch.device, lr: float, max_norm: float):
    """torchtitan's model, FSDP wrapping, compile, loss, optimizer (with its balancing hook)
    and clipping, each from its own builders with its JobConfig's defaults; only the shapes,
    the learning rate and the clipping norm are ours. Returns (load, step, counts, optimizer,
    info) as `vs_torchtitan.build_ours` does."""
    qwen3 = import_torchtitan_qwen3()
    from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.config import JobConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import clip_grad_norm_
    from torchtitan.models.llama4.infra.parallelize import apply_compile, apply_fsdp

    job = JobConfig()  # its defaults: fused AdamW, compile components model and loss
    job.optimizer.lr, job.training.max_norm = lr, max_norm
    job.compile.enable = args.compile
    margs = copy.deepcopy(qwen3.qwen3_args["30B-A3B"])
    for theirs, ours in TITAN_NAMES.items():
        setattr(margs, theirs, shapes[ours])
    margs.max_seq_len = args.seq  # the flavor's 262144 would only grow the RoPE cache
    moe = margs.moe_args
    moe.num_experts, moe.top_k = shapes["num_experts"], shapes["num_experts_per_tok"]
    moe.use_grouped_mm = device.type == "cuda"  # its row-padding kernel is Triton (GPU) only
    assert margs.moe_enabled and margs.qk_norm and not margs.enable_weight_tying  # as Qwen3
    assert (moe.score_func, moe.route_norm, moe.route_scale, moe.num_shared_experts) == (
        "softmax", True, 1.0, 0) and not moe.score_before_experts  # fmt: skip
    assert (margs.attn_type, margs.attn_mask_type) == ("sdpa", "causal")

    with torch.device("meta"):
        model = qwen3.Qwen3Model(margs)
    counts = sum(p.numel() for p in model.parameters()), sum(
        p.numel() for n, p in model.named_parameters() if ".moe.experts." in n)  # fmt: skip
    if args.compile:  # before FSDP, in the order of torchtitan's parallelize_qwen3
        apply_compile(model, job.compile, ep_enabled=False)
    param_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    apply_fsdp(model, mesh, param_dtype=param_dtype, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    model.train()
    loss_fn = build_cross_entropy_loss(job)  # compiled when compile is on (its default)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    optimizers = build_optimizers_with_moe_load_balancing([model], job.optimizer, dims)
    params = list(model.parameters())
    calls = [0]  # its trainer's step counter, for its log_freq

    def load(tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[accum, 1, seq + 1] host tokens -> its loader's (inputs, labels) pairs, on the
        host (its trainer copies each micro-batch to the device inside the step)."""
        return [(t[:, :-1], t[:, 1:]) for t in tokens]

    def step(micro_batches) -> torch.Tensor:
        optimizers.zero_grad()
        local_tokens = torch.tensor(0, dtype=torch.int64)
        for _, labels in micro_batches:
            local_tokens += (labels != IGNORE_INDEX).sum()
        global_tokens = local_tokens.to(device).float()  # one rank: no all-reduce
        losses = []
        for inputs, labels in micro_batches:
            inputs, labels = inputs.to(device), labels.to(device)
            pred = model(inputs)
            loss = loss_fn(pred, labels) / global_tokens
            del pred  # as its trainer: free the logits before backward
            loss.backward()
            losses.append(loss.detach())
        norm = clip_grad_norm_(params, job.training.max_norm, foreach=True)
        optimizers.step()
        loss = torch.sum(torch.stack(losses))
        calls[0] += 1
        if calls[0] == 1 or calls[0] % job.metrics.log_freq == 0:  # its should_log
            loss.item(), norm.item()
        return loss

    flavor = {k: v for k, v in vars(margs).items() if not k.startswith("_") and k != "moe_args"}
    flavor["moe_args"] = {k: v for k, v in vars(moe).items() if not k.startswith("_")}
    info = {
        "torchtitan_version": sys.modules["torchtitan"].__version__,
        "model_args": flavor,
        "compile_components": job.compile.components if args.compile else [],
        "step": "torchtitan 0.2.2 Trainer.train_step restated (benchmarks/titan_side.py)",
    }
    return load, step, counts, optimizers, info

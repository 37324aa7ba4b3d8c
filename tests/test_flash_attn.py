"""`parallel.cp_kernel=flash_attn` on CPU: every refusal before launch (exit 2, the key, the
problem, the install command), the documents and windows as the kernel is handed them, and
the core swapped in from outside. The kernel itself runs on a GPU: tests/test_gpu.py.

The machine is simulated where it matters (a GPU's compute capability, the package
installed or not): the preflight's probe of it is replaced by a `FlashAttnHost`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moetrain import train
from moetrain.build.model import meta_model
from moetrain.config.load import load_config
from moetrain.loop import preflight
from moetrain.models import get_model_spec
from moetrain.models.common.attention import AttentionCore
from moetrain.models.common.visibility import block_mask, document_mask
from moetrain.parallelisms.attention_kernels import resolve_kernel
from moetrain.parallelisms.dims import ParallelDims
from moetrain.parallelisms.flash_attention import (
    DocumentSpans,
    FlashAttentionCore,
    apply_flash_attention,
    cu_seqlens,
    window_size,
)
from moetrain.parallelisms.flash_attn_support import (
    INSTALL,
    KEY,
    VERSION,
    FlashAttnHost,
    FlashAttnUse,
    flash_attn_problems,
)
from moetrain.parallelisms.plan import match_modules
from tests.distributed import ROOT

HOPPER = FlashAttnHost("cuda", (9, 0), VERSION, "4.8.1")
BLACKWELL = FlashAttnHost("cuda", (10, 0), VERSION, "4.8.1")
QWEN3 = "configs/debug_qwen3_moe.toml"
GPT_OSS = "configs/debug_gpt_oss.toml"
BF16 = "--train.mixed_precision=bf16"
MLA = ["--model.qk_nope_head_dim=128", "--model.qk_rope_head_dim=64", "--model.v_head_dim=128"]


@pytest.fixture
def launch(monkeypatch, capsys):
    """train.main's answer (exit code, stderr) on a simulated machine (None: this one)."""
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)

    def run(host, config, *overrides, world_size=1):
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        if host is not None:
            monkeypatch.setattr(preflight, "probe_host", lambda device: host)
        rc = train.main([f"--config={config}", "--parallel.cp_kernel=flash_attn", *overrides])
        return rc, capsys.readouterr().err

    return run


REFUSALS = [  # host, config, overrides, world size, what the message says
    (None, QWEN3, [], 1, "it runs on CUDA only, but training runs on cpu"),
    (
        FlashAttnHost("cuda", (8, 0), VERSION, "4.8.1"),
        QWEN3,
        [BF16],
        1,
        "compute capability 8.0; flash-attn-4 trains on 9.x",
    ),
    (FlashAttnHost("cuda", (9, 0), None, None), QWEN3, [BF16], 1, "flash-attn-4 is not installed"),
    (
        FlashAttnHost("cuda", (9, 0), "4.0.0b20", "4.8.1"),
        QWEN3,
        [BF16],
        1,
        "flash-attn-4 4.0.0b20 is installed, but the ring calls the backward of 4.0.0b36",
    ),
    (HOPPER, QWEN3, ["--train.mixed_precision=fp32"], 1, "set train.mixed_precision=bf16"),
    (HOPPER, QWEN3, [BF16, "--model.head_dim=12"], 1, "head dims 12 (q, k) and 12 (v)"),
    (BLACKWELL, QWEN3, [BF16, "--model.head_dim=160"], 1, "up to 128, 192/128 or 256/256"),
    (BLACKWELL, GPT_OSS, [BF16, "--model.head_dim=256"], 1, "the attention sinks would get no"),
    # GPT-OSS's sliding windows in the ring
    (HOPPER, GPT_OSS, [BF16, "--parallel.cp=2"], 2, "carry document masks or sliding windows"),
]


@pytest.mark.parametrize("host,config,overrides,world_size,says", REFUSALS)
def test_flash_attn_refused_before_launch(launch, host, config, overrides, world_size, says):
    rc, err = launch(host, config, *overrides, world_size=world_size)
    assert rc == 2, err
    assert err.startswith(f"error: {KEY} cannot run here:"), err
    assert says in err and INSTALL in err, err


def test_flash_attn_documents_in_the_ring_refused_by_the_config(launch):
    rc, err = launch(HOPPER, QWEN3, BF16, "--parallel.cp=2", "--data.document_mask=true")
    assert rc == 2 and "flash_attn cannot apply document masks" in err, err
    assert "in the ring of parallel.cp=2" in err and "use parallel.cp_kernel=auto" in err, err


@pytest.mark.parametrize(
    "host,config,overrides",
    [
        (HOPPER, QWEN3, ["--data.document_mask=true"]),  # documents through varlen
        (HOPPER, GPT_OSS, ["--data.document_mask=true"]),  # windows and sinks
        (HOPPER, QWEN3, ["--parallel.cp=2"]),  # the ring without masks
        (BLACKWELL, "configs/debug_deepseek_v3.toml", ["--parallel.cp=2", *MLA]),
    ],
)
def test_flash_attn_accepted_where_it_runs(host, config, overrides):
    """No false refusal: the check passes the runs the kernel can take."""
    cfg = load_config([f"--config={ROOT / config}", BF16, *overrides])
    spec = get_model_spec(cfg.model.name)
    dims = ParallelDims.of(cfg.parallel, cfg.parallel.cp)
    preflight.check_flash_attn(cfg, dims, spec, meta_model(spec, cfg.model.args), host)


def test_gqa_with_two_head_dims_refused_on_hopper_only():
    """Checked at the call (the model's KV heads are not part of its contract): Hopper's
    backward asserts one head dim under GQA; Blackwell's and MLA's (no GQA) are fine."""
    mla = FlashAttnUse(torch.bfloat16, 192, 128, grouped=True)
    assert "Hopper backward takes GQA with one head dim only" in flash_attn_problems(HOPPER, mla)[0]
    assert flash_attn_problems(BLACKWELL, mla) == []
    assert flash_attn_problems(HOPPER, replace(mla, grouped=False)) == []
    assert flash_attn_problems(HOPPER, replace(mla, v_head_dim=192)) == []


def test_resolve_kernel_refuses_flash_attn_off_cuda_and_masked():
    with pytest.raises(ValueError, match="runs on CUDA only, but training runs on cpu"):
        resolve_kernel("flash_attn", torch.device("cpu"), 64, 64, False, torch.bfloat16)
    with pytest.raises(ValueError, match="carry document masks or sliding windows"):
        resolve_kernel("flash_attn", torch.device("cpu"), 64, 64, True, torch.bfloat16)


def test_cu_seqlens_cut_exactly_the_documents():
    """The spans laid end to end, as one block-diagonal mask over the B * S tokens, equal
    the document mask of each row (and nothing crosses rows: a row that is one document
    and a next row starting with the same id are two documents)."""
    ids = torch.tensor(
        [
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            [0, 0, 1, 1, 1, 2, 3, 3, 3, 3],
            [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
            [5, 5, 5, 5, 5, 7, 7, 7, 7, 7],
        ]
    )
    offsets = cu_seqlens(ids)
    assert offsets.dtype == torch.int32 and offsets[0] == 0 and offsets[-1] == ids.numel()
    span = torch.repeat_interleave(torch.arange(len(offsets) - 1), offsets.diff().long())
    flat = span[:, None] == span[None, :]  # [B*S, B*S]: same span
    expected = torch.block_diag(*(document_mask(row[None], causal=False)[0, 0] for row in ids))
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 3, 7, None])
def test_window_size_is_the_cores_window(causal, window):
    """flash-attn-4's rule (query i sees keys i - left .. i + right, causal: none after i)
    with our (left, right) is the core's `block_mask`."""
    left, right = window_size(causal, window)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    theirs = torch.ones(12, 12, dtype=torch.bool)
    if left is not None:
        theirs &= j >= i - left
    if right is not None:
        theirs &= j <= i + right
    if causal:
        theirs &= j <= i
    zeros, pos = torch.zeros(1, 12, dtype=torch.int64), torch.arange(12)
    assert torch.equal(theirs, block_mask(zeros, zeros, pos, pos, causal, window)[0])


def test_flash_attention_core_swapped_in_from_outside():
    """Every core the plan names is replaced, keeping its scale, causality and window
    (GPT-OSS: windows on alternate layers); parameter names do not change; one document
    cache serves every layer, recomputed for new ids or ids written in place."""
    spec = get_model_spec("gpt_oss")
    cfg = load_config([f"--config={ROOT / GPT_OSS}"])
    model = meta_model(spec, cfg.model.args)
    names = list(model.state_dict())
    cores = match_modules(model, spec.plan.attention_core, "attention_core")
    before = [(fqn, core.scale, core.causal, core.window) for fqn, core in cores]
    installed = apply_flash_attention(model, cores)
    flash = [(fqn, m) for fqn, m in model.named_modules() if isinstance(m, FlashAttentionCore)]
    after = [(fqn, m.scale, m.causal, m.window) for fqn, m in flash]
    assert after == before and {w for *_, w in before} == {None, cfg.model.args.sliding_window}
    assert not any(isinstance(m, AttentionCore) for m in model.modules())
    assert list(model.state_dict()) == names
    assert len({id(core.spans) for core in installed}) == 1
    spans, ids = DocumentSpans(), torch.tensor([[0, 0, 1, 1]])
    first = spans.of(ids)
    assert spans.of(ids) is first  # the next layer: no new sync
    ids[0, 1] = 1  # written in place: recomputed
    assert spans.of(ids).tolist() == [0, 1, 4]
    assert spans.of(torch.tensor([[0, 1, 2, 3]])).tolist() == [0, 1, 2, 3, 4]


class _CoreCalled(Exception):
    pass


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("debug_*.toml")))
def test_attention_shape_says_which_models_pass_sinks(config):
    """`AttentionShape.sinks` (what the check before launch reads) against what the model
    hands its first attention core, on the meta device (stopped there: no data needed)."""
    cfg = load_config([f"--config={ROOT / 'configs' / config}"])
    spec = get_model_spec(cfg.model.name)
    model = meta_model(spec, cfg.model.args)

    def stop(core, args, kwargs):
        raise _CoreCalled((args[4] if len(args) > 4 else kwargs.get("sinks")) is not None)

    for module in model.modules():
        if isinstance(module, AttentionCore):
            module.register_forward_pre_hook(stop, with_kwargs=True)
    with pytest.raises(_CoreCalled) as called:
        model(torch.zeros(1, 16, dtype=torch.int64, device="meta"))
    assert called.value.args[0] == spec.attention.sinks


def test_the_planner_judges_flash_attn_on_the_gpus_it_plans_for(capsys):
    """A plan is made on a machine without the GPUs (this CPU one): flash_attn is judged on
    the planned Hopper GPUs with the pinned package, not refused for want of CUDA here; what
    no GPU can run (fp32 compute) is still refused, as a launch would refuse it."""
    from moetrain.planner.cli import main

    config = ["--config", "configs/debug_qwen3_moe.toml", f"--{KEY}"]
    argv = ["--world-size=1", *config, "--train.device=auto"]  # a GPU launch, planned here
    assert main([*argv, "--train.mixed_precision=bf16"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main([*argv, "--train.mixed_precision=fp32"]) == 2
    err = capsys.readouterr().err
    assert KEY in err and "compute in float32" in err and "CUDA" not in err, err
    # A config that says CPU is planned on CPUs, where flash-attn-4 cannot run.
    assert main(["--world-size=1", *config, "--train.mixed_precision=bf16"]) == 2
    assert "runs on CUDA only, but training runs on cpu" in capsys.readouterr().err

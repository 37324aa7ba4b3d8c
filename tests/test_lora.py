"""LoRA (`[peft]`): fresh adapters compute the base model, merged weights compute the
adapted one, refusals before launch, and through train.py an exact resume and a merged
export that transformers reloads with the adapted model's logits. (Every layout against one
process, the optimizer holding the adapters alone and the base's bytes unchanged:
tests/test_layout_parity.py's LoRA rows.)"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from moetrain import train
from moetrain.build.lora import apply_lora, init_adapters
from moetrain.checkpoint.initial_adapters import load_peft_adapters
from moetrain.config import ConfigError, load_config
from moetrain.config.moe_peft import PeftSection
from moetrain.models import get_model_spec
from moetrain.models.common.lora import adapted_weights, is_adapter, merged
from tests.distributed import ROOT, run_train

ALL = '--peft.targets=["attention", "experts", "shared_experts"]'


def _models(argv: list[str]):
    """(plain model, LoRA model) of the config, the same base weights."""
    cfg = load_config(argv)
    spec = get_model_spec(cfg.model.name)
    plain, adapted = spec.build(cfg.model.args), spec.build(cfg.model.args)
    count = apply_lora(adapted, spec.plan, cfg.peft, cfg.model.name)
    assert count > 0
    plain.init_weights(0)
    adapted.init_weights(0)
    init_adapters(adapted, 0)
    return plain.eval(), adapted.eval()


@pytest.mark.parametrize(
    "argv",
    [["--config=configs/debug_qwen3_moe.toml"], ["--config=configs/debug_deepseek_v3.toml", ALL]],
    ids=["qwen3_moe", "deepseek_v3"],
)
def test_fresh_adapters_compute_the_base_model_and_merged_weights_the_adapted_one(argv):
    plain, adapted = _models([*argv, "--peft.method=lora"])
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = plain(ids).logits
        assert torch.equal(adapted(ids).logits, base)  # B = 0: step 0 is the base model
        frozen = [n for n, p in adapted.named_parameters() if not p.requires_grad]
        assert frozen == [n for n, _ in adapted.named_parameters() if not is_adapter(n)]
        for name, p in adapted.named_parameters():  # as if trained
            if name.endswith("lora_B"):
                p.normal_(0, 0.05)
        want = adapted(ids).logits
        params, plain_params = dict(adapted.named_parameters()), dict(plain.named_parameters())
        for name, (a, b, scale) in adapted_weights(adapted).items():
            plain_params[name].copy_(merged(params[name], params[a], params[b], scale))
        got = plain(ids).logits
    assert (want - base).abs().max() > 1e-2  # the adapters change the model
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()  # and merge into it


QWEN2_DENSE = ["--config=configs/debug_qwen2_moe.toml", "--model.mlp_only_layers=[0,1,2,3]"]


@pytest.mark.parametrize(
    "extra,expected",
    [
        (['--peft.targets=["shared_experts"]'], "model 'qwen3_moe' as configured has no shared"),
        (["--peft.targets=[]"], "would train nothing"),
        # Modules the plan names but this configuration does not build: the user's key.
        (
            [
                "--config=configs/debug_deepseek_v3.toml",
                "--model.n_shared_experts=0",
                '--peft.targets=["shared_experts"]',
            ],
            "remove shared_experts from peft.targets",
        ),  # fmt: skip
        ([*QWEN2_DENSE, '--peft.targets=["experts"]'], "remove experts from peft.targets"),
    ],
    ids=["qwen3_shared", "none", "dsv3_no_shared", "qwen2_dense_experts"],
)
def test_targets_the_model_lacks_are_refused_before_launch(extra, expected, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--config=configs/debug_qwen3_moe.toml", "--peft.method=lora", *extra]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "fix the model's PLAN" not in err


def test_expert_parallelism_over_a_configuration_without_experts_names_the_key(monkeypatch, capsys):
    from moetrain.planner.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["--world-size", "2", *QWEN2_DENSE, "--parallel.ep=2"]) == 2
    err = capsys.readouterr().err
    assert "set parallel.ep=1" in err and "fix the model's PLAN" not in err


@pytest.mark.parametrize(
    "config,targets,weight,limit",
    [
        # k_proj [64, 128] (2 kv heads of 32) is the narrowest weight
        ("debug_qwen3_moe", '["attention", "experts"]', "layers.0.self_attn.k_proj.weight", 64),
        # the experts alone: down_proj [E, 128, 64], gate_up_proj [E, 128, 128]
        ("debug_qwen3_moe", '["experts"]', "layers.1.mlp.experts.down_proj", 64),
        # MLA's kv_b_proj reads the 32-wide compressed kv
        ("debug_deepseek_v3", ALL.split("=", 1)[1], "layers.0.self_attn.kv_b_proj.weight", 32),
    ],
)
def test_a_rank_above_an_adapted_weights_rank_is_refused_before_launch(
    config, targets, weight, limit, capsys, monkeypatch
):
    """issue 52, item 22: peft.rank=100000 on width 64 trained 448M adapter parameters."""
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    argv = [f"--config=configs/{config}.toml", "--peft.method=lora", f"--peft.targets={targets}"]
    assert train.main([*argv, f"--peft.rank={limit + 1}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: peft.rank={limit + 1} is above what the LoRA update of {weight}")
    assert f"set peft.rank <= {limit}" in err
    cfg = load_config([*argv, f"--peft.rank={limit}"])  # full rank: accepted
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        assert apply_lora(spec.build(cfg.model.args), spec.plan, cfg.peft, cfg.model.name) > 0


def test_experts_without_a_lora_form_are_refused():
    cfg = load_config(["--config=configs/debug_gpt_oss.toml", "--peft.method=lora"])
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"), pytest.raises(Exception, match="have no LoRA form"):
        apply_lora(spec.build(cfg.model.args), spec.plan, cfg.peft, cfg.model.name)


LORA_RUN = [
    "--config=configs/debug_qwen3_moe.toml",
    "--data.max_tokens=200000",
    "--metrics.log_interval=1",
    "--train.steps=4",
    "--train.warmup_steps=2",
    "--checkpoint.interval=2",
    "--peft.method=lora",
    "--parallel.ep=2",
]


@pytest.mark.slow
def test_resume_is_exact_and_the_merged_export_reloads_with_the_adapted_logits(tmp_path):
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    from moetrain.checkpoint.whole_model import load_checkpoint_model

    straight = run_train(LORA_RUN, tmp_path / "straight", nproc=2)
    resumed_dir = tmp_path / "resumed" / "checkpoints"
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "step-2", resumed_dir / "step-2")
    resumed = run_train(LORA_RUN, tmp_path / "resumed", nproc=2)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == ref["loss"] and ours["grad_norm"] == ref["grad_norm"]

    step = tmp_path / "straight" / "checkpoints" / "step-4"
    # The adapters and their optimizer state alone (checkpoint.save_frozen=false).
    saved = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in saved if k.startswith("model.")}
    assert weights and all(is_adapter(k) or "correction_bias" in k for k in weights)
    state = [k.split(".", 2)[-1].rsplit(".", 1)[0] for k in saved if k.startswith("optim.state.")]
    assert state and all(is_adapter(k) for k in state)
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "moetrain.export", "--checkpoint", str(step), "--out",
           str(out), "--dtype", "fp32"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # Read with other adapters than it was trained with: refused, naming the key.
    cmd = [sys.executable, "-m", "moetrain.evaluate", "--config=configs/debug_qwen3_moe.toml",
           "--checkpoint", str(step), "--data.max_tokens=200000", "--eval.fraction=0.05",
           "--eval.samples=16"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "peft.method: checkpoint 'lora', this run 'none'" in proc.stderr

    # Trained on EP 2, the routed experts' adapters export as peft target_parameters.
    _export(step, tmp_path / "adapters", "--adapters")
    written = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.experts.gate_up_proj" in written["target_parameters"]

    ours, _, _ = load_checkpoint_model(str(step))  # the adapted model, adapters apart
    assert any(p.abs().max() > 0 for n, p in ours.named_parameters() if n.endswith("lora_B"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = ours(ids).logits, theirs(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _export(step, out, *extra: str, subprocess_cli: bool = False) -> str:
    """The export's command line, in process (its `main`), or as `python -m moetrain.export`
    (`subprocess_cli`: the entry point itself, at the cost of a fresh interpreter's imports);
    returns what it printed."""
    argv = ["--checkpoint", str(step), "--out", str(out), *extra]
    if subprocess_cli:
        cmd = [sys.executable, "-m", "moetrain.export", *argv]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout
    from moetrain.export.cli import main as export

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = export(argv)
    assert code == 0, printed.getvalue()
    return printed.getvalue()


@pytest.mark.slow
def test_the_adapter_export_is_what_peft_loads_and_a_later_export_replaces_it(
    tmp_path, capsys, monkeypatch
):
    transformers = pytest.importorskip("transformers", reason="needs the [hf] extra")
    peft = pytest.importorskip("peft", reason="needs the [hf] extra (peft)")
    from moetrain.checkpoint.whole_model import load_checkpoint_model
    from tests.chat_model import save_chat_model

    base_dir = tmp_path / "base"
    save_chat_model(base_dir)  # a tiny Qwen3-MoE in Hugging Face's format
    config = tmp_path / "lora.toml"
    config.write_text(
        '[model]\nname = "qwen3_moe"\n'
        '[data]\nsource = "stdlib"\ntokenizer = "byte"\nseq_len = 64\nmax_tokens = 100000\n'
        "[train]\nsteps = 2\nglobal_batch_size = 4\nmicro_batch_size = 2\nlr = 1e-2\n"
        'warmup_steps = 1\ndevice = "cpu"\nmixed_precision = "fp32"\n'
        "[checkpoint]\ninterval = 1\n"
        '[peft]\nmethod = "lora"\n'  # the default targets: attention and experts
    )
    run = tmp_path / "run"
    # On EP 2: the experts' adapters trained split over ranks, exported whole for peft.
    run_train([f"--config={config}", f"--model.init_from_hf={base_dir}", "--parallel.ep=2"],
              run, nproc=2)  # fmt: skip
    step = run / "checkpoints" / "step-2"
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "adapters"
    # no --dtype: the dtype they trained in; through `python -m`, as a user runs it
    printed = _export(step, out, "--adapters", subprocess_cli=True)
    assert f"wrote {out}: adapters in fp32 (the checkpoint's dtype; --dtype" in printed
    merged_dir = tmp_path / "merged"
    printed = _export(step, merged_dir, "--dtype", "fp32")
    assert f"wrote {merged_dir}: weights in fp32 (--dtype) from {step}" in printed

    ours, _, _ = load_checkpoint_model(str(step))  # the base from init_from_hf, its adapters
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = base(input_ids=ids).logits  # before peft puts the adapters into it
    theirs = peft.PeftModel.from_pretrained(base, out).eval()
    adapted = [n for n, _ in theirs.named_modules() if n.endswith(".lora_A")]
    # q, k, v, o, and the experts' gate_up_proj and down_proj, of every layer
    assert len(adapted) == 6 * ours.args.num_hidden_layers
    with torch.no_grad():
        want, got = ours(ids).logits, theirs(input_ids=ids).logits
    assert (want - plain).abs().max() > 1e-4  # the adapters trained, the experts' too:
    assert ours.get_parameter("layers.0.mlp.experts.down_lora_B").abs().max() > 0
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # The adapters on the base are the merged export, on the defaults: bf16 adapters (the
    # old default) were 3.2e-3 away here.
    merged_model = transformers.AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    with torch.no_grad():
        assert (merged_model(input_ids=ids).logits - got).abs().max() <= 1e-4

    # peft.init_from: a model with fresh adapters, given the exported ones, is `ours`.
    fresh, spec, args = load_checkpoint_model(str(step))
    init_adapters(fresh, seed=7)
    peft_cfg = PeftSection(method="lora", init_from=str(out))
    load_peft_adapters(fresh, fresh, spec.hf_adapter, args, peft_cfg)
    with torch.no_grad():
        assert (fresh(ids).logits - want).abs().max() <= 1e-6 * want.abs().max()
    for key, value in (("rank", 4), ("alpha", 8.0)):
        other = PeftSection(method="lora", init_from=str(out), **{key: value})
        with pytest.raises(ConfigError, match=f"peft.{key}={value}"):
            load_peft_adapters(fresh, fresh, spec.hf_adapter, args, other)
    other = PeftSection(method="lora", init_from=str(out), targets=["attention"])
    with torch.device("meta"):
        attention_only = spec.build(args)
    apply_lora(attention_only, spec.plan, other, spec.name)
    with pytest.raises(ConfigError, match=r"peft.targets=\['attention'\] \(it lacks \[\], has"):
        load_peft_adapters(attention_only, attention_only, spec.hf_adapter, args, other)

    # Through train.py on 2 ranks (each loads its shards of the adapters): a run that starts
    # from the exported adapters takes the same first step as a stage from the checkpoint.
    one = [f"--config={config}", f"--model.init_from_hf={base_dir}", "--train.steps=1",
           "--checkpoint.interval=0", "--metrics.log_interval=1"]  # fmt: skip
    from_peft = run_train([*one, f"--peft.init_from={out}"], tmp_path / "from_peft", nproc=2)
    stage = run_train([*one, f"--checkpoint.init_from={step}"], tmp_path / "stage", nproc=2)
    assert from_peft[0]["loss"] == pytest.approx(stage[0]["loss"], rel=1e-6)
    assert from_peft[0]["grad_norm"] == pytest.approx(stage[0]["grad_norm"], rel=1e-5)

    # Exports into the same directory: each loads as itself, nothing of the one before.
    # Merged weights over the adapters (a stale adapter_config.json would make transformers
    # put the adapters on the base named in it), then sharded over one file (a stale
    # model.safetensors is what transformers would load instead of the index).
    for checkpoint, extra in (("step-1", ()), ("step-2", ("--max-shard-gb=0.00005",))):
        _export(run / "checkpoints" / checkpoint, out, "--dtype=fp32", *extra)
        model, _, _ = load_checkpoint_model(str(run / "checkpoints" / checkpoint))
        _export(run / "checkpoints" / checkpoint, tmp_path / "fresh", "--dtype=fp32", *extra)
        assert sorted(p.name for p in out.iterdir()) == sorted(
            p.name for p in (tmp_path / "fresh").iterdir()
        )
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            want, got = model(ids).logits, theirs(input_ids=ids).logits
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        shutil.rmtree(tmp_path / "fresh")

    # Other weights at the base's path: the adapters would apply to another model, so a
    # resume, an evaluation and the export refuse, naming the path (its content fingerprint).
    save_chat_model(base_dir, seed=1)
    from moetrain.export.cli import main as export

    cmd = ["--checkpoint", str(step), "--out", str(tmp_path / "merged")]
    assert export(cmd) == 2
    assert f"the weights at {base_dir} changed since" in capsys.readouterr().err
    relaunch = [f"--config={config}", f"--model.init_from_hf={base_dir}", "--train.steps=3",
                f"--job.output_dir={run}"]  # fmt: skip
    assert train.main(relaunch) == 2
    assert f"the weights at {base_dir} changed since" in capsys.readouterr().err


def test_a_bf16_base_without_lora_is_refused_naming_the_key(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert train.main(["--config=configs/debug_qwen3_moe.toml", "--peft.base_dtype=bf16"]) == 2
    assert "peft.base_dtype=bf16 needs peft.method=lora" in capsys.readouterr().err

"""Generation's KV cache (moetrain/generate/kv_cache.py, batched.py) on tiny random models of
three attention kinds, each saved by transformers and loaded as `python -m moetrain.generate`
loads an export: Qwen3-MoE (GQA, YaRN), DeepSeek-V3 (MLA; also built with an MTP module)
and GPT-OSS (sliding windows shorter than the prompts, large sinks). A left-padded batch of
prompts of different lengths, decoded with the cache, against the full-forward decoder of
the same model (the same ids, logits close at every step) and against transformers' greedy
`generate` on the saved model, one prompt at a time (the same ids, the same stop)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetrain.generate import batched
from moetrain.generate.batched import generate_batch, left_padded
from moetrain.generate.decode import generate_uncached
from moetrain.generate.kv_cache import cached_attention
from moetrain.generate.load import load_model
from moetrain.models import get_model_spec
from moetrain.models.common.attention import AttentionCore
from tests.families import FAMILIES
from tests.families.models import hf_model

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")


def _tiny(family: str, case: str):
    """transformers' tiny model of a family's case (tests/families/)."""
    return lambda: hf_model(transformers, FAMILIES[family], case)


MODELS = {
    "qwen3_moe_yarn": _tiny("qwen3_moe", "yarn"),
    "deepseek_v3_mla": _tiny("deepseek_v3", "qlora_group4"),
    # YaRN's softmax scale on the core, queries without LoRA
    "deepseek_v3_mla_yarn_plain_q": _tiny("deepseek_v3", "yarn_v3_mscale_no_truncate_plain_q"),
    # windows of 5 tokens on layers 0 and 2, sinks x20
    "gpt_oss_window_sinks": _tiny("gpt_oss", "window_gqa_top2"),
}
LENGTHS = (3, 11, 17, 6)  # every row but one padded; longer than GPT-OSS's window
NEW = 10


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory):
    """(transformers' model, ours loaded from its directory as an export, our plan)."""
    hf_model = MODELS[request.param]()
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory)
    ours, plan = load_model("export", str(directory), torch.device("cpu"))
    return hf_model, ours, plan


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(len(LENGTHS))
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _step_logits_cached(model, plan, prompts, continuations) -> torch.Tensor:
    """[B, steps, V]: the logits of each step when each row's continuation is fed through
    the cache one token a step after its left-padded prompt."""
    ids, positions, documents = left_padded(prompts, torch.device("cpu"))
    steps = len(continuations[0])
    with torch.no_grad(), cached_attention(model, plan) as cache:
        cache.start(ids.shape[1] + steps)
        logits = [model(ids, positions, documents).logits[:, -1]]
        for t in range(steps - 1):
            new = torch.tensor([[c[t]] for c in continuations])
            positions = positions[:, -1:] + 1
            logits.append(model(new, positions, torch.ones_like(new)).logits[:, -1])
    return torch.stack(logits, dim=1)


def _step_logits_full(model, prompt, continuation) -> torch.Tensor:
    """[steps, V]: the same logits from one full forward of the unpadded row."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + continuation[:-1]])).logits[0]
    return logits[len(prompt) - 1 :]


def _check_cached_logits(model, plan) -> None:
    prompts = _prompts(model.args.vocab_size)
    continuations = [generate_uncached(model, p, set(), NEW)[0] for p in prompts]
    cached = _step_logits_cached(model, plan, prompts, continuations)
    for row, (prompt, continuation) in enumerate(zip(prompts, continuations)):
        full = _step_logits_full(model, prompt, continuation)
        torch.testing.assert_close(cached[row], full, rtol=1e-4, atol=1e-4)
    assert all(type(m) is AttentionCore for m in model.modules() if hasattr(m, "causal"))


def _check_batched_greedy(model, plan, hf_model=None) -> None:
    prompts = _prompts(model.args.vocab_size)
    free = [generate_uncached(model, p, set(), NEW)[0] for p in prompts]
    stop = free[1][4]  # a token greedy decoding of one prompt reaches: taken as the stop
    answers = generate_batch(model, plan, prompts, {stop}, NEW)
    uncached = [generate_uncached(model, p, {stop}, NEW) for p in prompts]
    assert [(a.ids, a.stopped) for a in answers] == uncached
    assert answers[1].stopped and len(answers[1].ids) <= 5
    assert any(len(a.ids) == NEW and not a.stopped for a in answers)  # rows that ran on
    if hf_model is None:
        return
    theirs = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW,
                eos_token_id=stop,
                pad_token_id=stop,
            )
        theirs.append(out[0, len(prompt) :].tolist())
    assert [a.ids for a in answers] == theirs


def test_cached_logits_are_the_full_forward_logits(saved):
    _, ours, plan = saved
    _check_cached_logits(ours, plan)


def test_batched_greedy_is_the_uncached_and_transformers_greedy(saved):
    hf_model, ours, plan = saved
    _check_batched_greedy(ours, plan, hf_model)


def test_a_prompt_prefilled_a_token_at_a_time_gets_the_same_answers(saved, monkeypatch):
    """A prefill in chunks (here one position each, pads first) fills the cache as one."""
    _, ours, plan = saved
    prompts = _prompts(ours.args.vocab_size)
    whole = generate_batch(ours, plan, prompts, set(), 4)
    monkeypatch.setattr(batched, "PREFILL_LOGITS", 1)
    assert generate_batch(ours, plan, prompts, set(), 4) == whole
    assert [generate_batch(ours, plan, [p], set(), 4)[0] for p in prompts] == whole


def test_deepseek_v3_with_mtp_decodes_with_its_main_model(tmp_path):
    """MTP modules are trained, not run at generation: the model's forward skips them
    without their inputs, and their cores (replaced too) are never called."""
    _tiny("deepseek_v3", "qlora_group4")().save_pretrained(tmp_path)
    spec = get_model_spec("deepseek_v3")
    args = dataclasses.replace(
        spec.hf_adapter.load_hf_config(str(tmp_path)), num_nextn_predict_layers=1
    )
    model = spec.build(args)
    model.init_weights(3)
    model.eval()
    assert model.mtp is not None
    _check_cached_logits(model, spec.plan)
    _check_batched_greedy(model, spec.plan)

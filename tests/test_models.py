"""The model suite: every registered model against Hugging Face transformers (eager, fp32,
tiny random configs with norms, biases and routing biases perturbed so that they matter),
from its table in tests/families/. One test per (family, case) or per family, so that a
failure names both and hides no other.

- logits (and the aux loss and the loss, where transformers computes them) of a checkpoint
  transformers saved, read through the trainer's own loader;
- packed documents against transformers run on each document alone;
- a sharded transformers checkpoint exported back reproduces transformers' logits;
- the export of a native model reloads in transformers (no missing or unexpected key, equal
  logits, routing biases) and in ours (the same args, bit-equal logits, no routing counts);
- a checkpoint whose expert width differs from config.json's is refused.

config.json, refusals and bounds: tests/test_model_configs.py; the parallel layouts:
tests/test_model_layouts.py; what only one family has: tests/test_<family>.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moetrain.data.packing import document_positions
from moetrain.hf.weights import load_hf_weights, save_hf_checkpoint
from moetrain.models import model_names
from moetrain.models.common.balance_losses import load_balancing_loss
from tests.families import FAMILIES
from tests.families.family import Aux, Family
from tests.families.models import (
    SEQ,
    counted_routing,
    hf_model,
    max_diff,
    native_args,
    native_model,
    our_moe_layers,
    ours_from_dir,
    positions,
    spec_of,
    their_moe_layers,
    token_ids,
)

transformers = pytest.importorskip("transformers", reason="needs the [hf] extra (transformers)")

EACH_CASE = [
    pytest.param(family, case, id=f"{name}-{case}")
    for name, family in FAMILIES.items()
    for case in family.cases
]
EACH_FAMILY = [pytest.param(family, id=name) for name, family in FAMILIES.items()]
TOLERANCE = 1e-4  # max |logit difference|, fp32 (logits up to about 5)


def test_every_registered_model_has_a_table():
    assert sorted(FAMILIES) == model_names()


def _correction_biases(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Each layer's routing bias, flattened (ERNIE-4.5 keeps it [1, E] in transformers)."""
    found = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        layer = re.search(r"layers\.(\d+)\..*e_score_correction_bias$", name)
        if layer:
            found[int(layer[1])] = t.detach().flatten()
    return found


@pytest.mark.parametrize("family, case", EACH_CASE)
def test_logits_aux_and_loss_match_transformers(family: Family, case: str, tmp_path):
    """Also: the checkpoint transformers saves (per-expert keys) reads as the case's args,
    with the same MoE layers; a routing bias steers the choice of experts."""
    theirs_model = hf_model(transformers, family, case)
    theirs_model.save_pretrained(tmp_path)
    ours = ours_from_dir(family, tmp_path)
    want = native_args(family, case)
    resolved = {key: getattr(want, key) for key in family.resolved_on_save}
    assert dataclasses.replace(ours.args, **resolved) == want
    assert our_moe_layers(ours) == their_moe_layers(theirs_model)
    assert our_moe_layers(ours) == family.moe_layers.get(case, our_moe_layers(ours))

    ids, labels, pos = token_ids(family, (2, SEQ), 1), token_ids(family, (2, SEQ), 2), None
    if family.position_offset:
        pos = positions(family, SEQ)
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)  # HF shifts inside its loss
    with torch.no_grad():
        theirs = theirs_model(
            ids, position_ids=pos, labels=labels, output_router_logits=family.aux is not Aux.NONE
        )
        out = ours(ids, pos)
    diff = max_diff(out.logits, theirs.logits)
    print(f"\n{family.name} {case}: max |logit diff| = {diff:.3g}")
    assert diff < TOLERANCE
    ce = F.cross_entropy(out.logits.flatten(0, 1), shifted.flatten(), ignore_index=-100)
    if family.aux is Aux.NONE:
        torch.testing.assert_close(ce, theirs.loss, rtol=1e-5, atol=1e-5)
    else:
        stats = out.router_stats
        aux = load_balancing_loss(stats, stats.tokens_per_expert.shape[-1], pooled=True)
        torch.testing.assert_close(aux, theirs.aux_loss, rtol=1e-5, atol=1e-6)
        loss = ce + spec_of(family).loss_terms(ours.args).aux_loss_coef * aux
        torch.testing.assert_close(loss, theirs.loss, rtol=1e-5, atol=1e-5)
    if family.aux is Aux.POOLED_UNBIASED_TOPK:  # the bias changed the choice: the counts differ
        assert not torch.equal(out.router_stats.tokens_per_expert, stats.prob_topk_per_expert)
    if family.correction_bias_std:  # the routing biases must steer, or parity means little
        theirs_biases = _correction_biases(theirs_model)
        assert theirs_biases and all(b.abs().max() > 0 for b in theirs_biases.values())
        with torch.no_grad():
            for bias in _correction_biases(ours).values():
                bias.zero_()
            unbiased = ours(ids, pos).logits
        assert max_diff(unbiased, out.logits) > 1e-3


@pytest.mark.parametrize("family", EACH_FAMILY)
def test_packed_documents_equal_transformers_run_per_document(family: Family, tmp_path):
    theirs_model = hf_model(transformers, family, family.packed_case)
    theirs_model.save_pretrained(tmp_path)
    ours = ours_from_dir(family, tmp_path)
    lengths = [9, 4, 11]
    docs = [token_ids(family, (n,), 10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs)[None]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    with torch.no_grad():
        out = ours(packed, document_positions(document_ids), document_ids).logits[0]
        alone = torch.cat([theirs_model(d[None]).logits[0] for d in docs])
    diff = max_diff(out, alone)
    print(f"\n{family.name} packed: max |logit diff| = {diff:.3g}")
    assert diff < TOLERANCE


@pytest.mark.parametrize("family", EACH_FAMILY)
def test_a_sharded_transformers_checkpoint_exports_back_to_itself(family: Family, tmp_path):
    theirs_model = hf_model(transformers, family, family.packed_case)
    theirs_model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # shards + index
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    ours = ours_from_dir(family, tmp_path / "hf")
    save_hf_checkpoint(ours, spec_of(family).hf_adapter, ours.args, str(tmp_path / "export"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", attn_implementation="eager"
    ).eval()
    ids = token_ids(family, (2, 13), 2)
    with torch.no_grad():
        want = theirs_model(ids).logits
        assert max_diff(ours(ids).logits, want) < TOLERANCE
        assert max_diff(reloaded(ids).logits, want) < TOLERANCE


@pytest.mark.parametrize("family, case", EACH_CASE)
def test_export_reloads_in_transformers_and_back(family: Family, case: str, tmp_path):
    """Routing counts of a training forward are not exported; the routing biases are."""
    args = native_args(family, case)
    ours = native_model(family, args)
    counts = counted_routing(ours)
    if counts:  # a training forward counts routing
        ours(token_ids(family, (1, 8), 0)).logits.sum().backward()
        assert all(c.sum() > 0 for c in counts)
    save_hf_checkpoint(ours.eval(), spec_of(family).hf_adapter, args, str(tmp_path))
    saved = load_file(tmp_path / "model.safetensors")
    assert not [key for key in saved if "tokens_per" in key]

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert type(reloaded).__name__ == family.hf_class
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids, pos = token_ids(family, (2, 13), 5), positions(family, 13)
    with torch.no_grad():
        want = ours(ids, pos).logits
        diff = max_diff(reloaded.eval()(ids, position_ids=pos).logits, want)
        back = ours_from_dir(family, tmp_path)
        again = back(ids, pos).logits
    print(f"\n{family.name} export {case}: max |logit diff| = {diff:.3g}")
    assert diff < TOLERANCE
    assert back.args == args
    assert torch.equal(again, want)
    assert not any(c.any() for c in counted_routing(back))
    biases = _correction_biases(ours)
    assert all(b.abs().min() > 0 for b in biases.values())
    exported = _correction_biases(reloaded)
    assert exported.keys() == biases.keys()
    assert all(torch.equal(exported[i], b) for i, b in biases.items())


@pytest.mark.parametrize("family", EACH_FAMILY)
def test_a_checkpoint_of_another_expert_width_is_refused(family: Family, tmp_path):
    hf_model(transformers, family, family.packed_case).save_pretrained(tmp_path)
    spec = spec_of(family)
    args = spec.hf_adapter.load_hf_config(str(tmp_path))
    width = getattr(args, family.expert_width_field)
    args = dataclasses.replace(args, **{family.expert_width_field: width // 2})
    with pytest.raises(ValueError, match="shape"):  # before any data is read
        load_hf_weights(spec.build(args), spec.hf_adapter, args, str(tmp_path))

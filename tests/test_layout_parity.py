"""Every parallel layout against one plain process on the same global batch (docs/overview.md, "Principles").

One table: each row is a layout (FSDP, HSDP, EP x FSDP, CP, CP x EP, pipeline stages) of a
tiny model, run for 3 steps (LoRA rows 5) on real gloo ranks through `Trainer.train_step`
and compared with `tests.parity.reference_run`, which has no parallel code (FP8 rows: each
step from the row's weights of the step before, the reference's FP8 forms applied as the
run applies them): losses, aux
and MTP losses, grad norms, every clipped gradient and updated parameter (fused AdamW on
most rows, the reference's foreach) within 1e-5 relative, buffers (routing biases and
counts) bit-equal. With expert parallelism, the all-to-all volume must equal the
drop-less minimum, counted independently from the routers' own outputs.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from moetrain.config import load_config
from moetrain.config.checks import ZBV_EXACT_FROM, torch_release
from moetrain.models import get_model_spec
from moetrain.models.common.lora import is_adapter
from tests.distributed import run_distributed
from tests.parity import TINY, TINY_DSV3, assert_same_training, layout_worker, reference_run


class Layout(NamedTuple):
    model: list[str]  # the tiny model's argv (TINY or TINY_DSV3)
    world: int
    layout: list[str]
    dp_size: int  # data-parallel ranks: how the reference groups micro-batches for aux
    routing: str | None = None  # "skewed": every token to experts 0..2 on both sides
    steps: int = 3


EP2, CP2 = "--parallel.ep=2", "--parallel.cp=2"
PP2, L4, TIED = "--parallel.pp=2", "--model.num_hidden_layers=4", "--model.tie_word_embeddings=true"
AC = "--train.activation_checkpoint=selective"
ZBV, DUALPIPEV = "--parallel.pp_schedule=ZBVZeroBubble", "--parallel.pp_schedule=DualPipeV"
# FP8 GEMMs (docs/parallelisms.md, "FP8 training"): their rows are compared step by step from
# the same weights (tests/parity.py, `reference_run`'s restart_from).
ROWWISE, TENSORWISE = "--train.fp8=rowwise", "--train.fp8=tensorwise"
# The reference steps foreach AdamW; the rows step the default, fused, except these (dense
# and expert meshes both).
FOREACH = "--train.optimizer_impl=foreach"
# Each layer's tokens in two chunks, one's all-to-all in flight under the other's experts;
# the other EP rows run the default overlap (shared).
CHUNKS = "--parallel.ep_overlap=chunks"
HSDP = ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]
GLOBAL_AUX = "--moe.aux_loss_mode=global_batch"
# The aux loss is per layer by default; pooled is Hugging Face's. z-loss weighted enough that
# its gradient shows in the routers' (losses and z_loss are compared on every row).
POOLED, Z_LOSS = "--moe.aux_loss_layers=pooled", "--moe.z_loss_coef=0.05"
# LoRA: the base frozen, adapters on attention and the routed experts (stacked per expert,
# sharded over ep), and on DeepSeek-V3's shared experts; clipping kept active.
LORA = ["--peft.method=lora", "--peft.rank=4", "--train.max_grad_norm=0.05"]
LORA_ALL = [*LORA, '--peft.targets=["attention", "experts", "shared_experts"]']
LAYOUTS = {
    # grad accumulation 2; 5 experts the 2 fsdp ranks do not divide: sharded by rows (dim 1)
    "fsdp2_experts_by_rows": Layout(TINY, 2, ["--model.num_experts=5"], 2),
    # ... in FP8, rowwise: the experts' weight scales per channel of the gathered rows.
    "fsdp2_experts_by_rows_fp8": Layout(TINY, 2, ["--model.num_experts=5", ROWWISE], 2),
    # Gathered and reduced once per step under accumulation (2 micro-batches a rank), the
    # replicas' all-reduce after the step's one reduce-scatter.
    "hsdp2x2_gather_step_accum2": Layout(
        TINY, 4, [*HSDP, FOREACH, "--parallel.fsdp_gather=step", "--train.micro_batch_size=1"], 4
    ),
    "hsdp2x2_ep2_pooled_aux": Layout(TINY, 4, [*HSDP, EP2, POOLED], 4),
    # (Plain FSDP with LoRA, and EP x FSDP with the default aux: subsets of the LoRA rows
    # and of ep2_global_batch_aux_z below.)
    # Experts 3..7 get no tokens; with ep 4, ranks 2 and 3 receive none at all.
    "ep4_skewed_idle_experts_chunks": Layout(TINY, 4, ["--parallel.ep=4", CHUNKS], 4, "skewed"),
    "ep2_global_batch_aux_z": Layout(TINY, 4, [EP2, GLOBAL_AUX, Z_LOSS], 4),
    "ep2_chunks": Layout(TINY, 4, [EP2, CHUNKS], 4),
    # ... in FP8 tensorwise: the experts' rows from both ranks' micro-batches, scaled row by row.
    "ep2_chunks_fp8": Layout(TINY, 4, [EP2, CHUNKS, TENSORWISE], 4),
    "cp2": Layout(TINY, 2, [CP2], 1),
    # ... in FP8 tensorwise: each activation's amax all-reduced over the cp ranks.
    "cp2_fp8": Layout(TINY, 2, [CP2, TENSORWISE], 1),
    "cp2_ep2_z": Layout(TINY, 4, [CP2, EP2, Z_LOSS], 2),  # EP borrows the cp ranks
    "cp2_contiguous_global_pooled_aux": Layout(
        TINY, 4, [CP2, "--parallel.cp_layout=contiguous", GLOBAL_AUX, POOLED], 2
    ),
    # DeepSeek-V3: MLA, group-limited routing with the bias update, MTP, sequence-wise aux.
    "dsv3_ep2_efsdp2_pooled_aux_chunks": Layout(TINY_DSV3, 4, [EP2, POOLED, CHUNKS], 4, steps=5),
    # ... the default overlap (the combine under the shared expert) over 5 steps
    "dsv3_ep2_efsdp2_shared": Layout(TINY_DSV3, 4, [EP2, FOREACH], 4, steps=5),
    "dsv3_ep4_2nodes_shared": Layout(
        TINY_DSV3, 4, ["--parallel.ep=4", "--parallel.ranks_per_node=2"], 4, steps=5
    ),
    "dsv3_cp2_ep2_z": Layout(TINY_DSV3, 4, [CP2, EP2, Z_LOSS], 2),
    "dsv3_cp2_ep2_lora": Layout(TINY_DSV3, 4, [CP2, EP2, *LORA_ALL], 2, steps=5),
    # An ep group over 2 simulated nodes of 2 ranks: the two-stage dispatch.
    "dsv3_ep4_2nodes_chunks": Layout(
        TINY_DSV3, 4, ["--parallel.ep=4", "--parallel.ranks_per_node=2", CHUNKS], 4, steps=5
    ),
    # HSDP with ep 2 over 2 nodes of 1 rank: the rail stage alone (a node's stage is one rank).
    # ... with LoRA: the experts' adapters travel the same way, the base replicated frozen.
    "hsdp2x2_ep2_1rank_nodes_lora": Layout(
        TINY, 4, [*HSDP, EP2, "--parallel.ranks_per_node=1", *LORA], 4
    ),
    # Pipeline stages (4 blocks where a rank holds two stages). ZBV: the backward split in
    # input and weight parts, with FSDP and EP inside each stage.
    # ... with the global-batch aux loss (counts over the stage's ranks), the z-loss, and a
    # tied head: the first and the last stage, each with the embedding, on one rank.
    # ... with `selective` recomputation: the input pass rebuilds the attention's inputs,
    # the weight pass the projections' inputs (moetrain/models/common/recompute.py).
    "pp2_zbv_dp2_ep2_global_aux_z_tied_selective": Layout(
        TINY, 4, [PP2, ZBV, EP2, L4, GLOBAL_AUX, Z_LOSS, TIED, AC], 2
    ),
    # 1F1B stages in FP8 rowwise with full checkpointing (each block's forward again).
    "pp2_1f1b_full_ac_fp8": Layout(
        TINY, 2, [PP2, L4, "--train.activation_checkpoint=full", ROWWISE], 1
    ),
    # ... and in the V schedule's backward split in input and weight passes, tensorwise (all
    # three GEMMs of each linear in FP8), with `selective` recomputation in either pass.
    "pp2_dualpipev_selective_fp8": Layout(TINY, 2, [PP2, DUALPIPEV, L4, AC, TENSORWISE], 1),
    # Looped stages over a ring; a tied head: the last stage's copy of the embedding.
    "pp2_interleaved_cp2_tied_selective_ac": Layout(
        TINY, 4, [PP2, "--parallel.pp_schedule=Interleaved1F1B", CP2, TIED, L4, AC], 1
    ),
    # ... with LoRA: a frozen embedding, yet the stages pass gradients back.
    "pp2_dualpipev_lora": Layout(TINY, 2, [PP2, DUALPIPEV, L4, *LORA], 1, steps=5),
    # ... with EP: each overlapped pair of a forward and a backward runs on two threads,
    # their all-to-alls taking turns (moetrain/parallelisms/pipeline_overlap.py).
    # ... with `selective` recomputation, rebuilt on the backward's thread.
    "pp2_dualpipev_ep2_overlap_selective": Layout(
        TINY, 4, [PP2, DUALPIPEV, EP2, L4, "--train.micro_batch_size=1", AC], 2
    ),
    # DeepSeek-V3 (MLA's up-projections recomputed, the MTP block on the last stage) in the
    # V schedules with EP and `selective`.
    "dsv3_pp2_zbv_ep2_selective": Layout(TINY_DSV3, 4, [PP2, ZBV, EP2, L4, AC], 2),
    "dsv3_pp2_dualpipev_ep2_selective": Layout(
        TINY_DSV3, 4, [PP2, DUALPIPEV, EP2, L4, "--train.micro_batch_size=1", AC], 2
    ),
    # DeepSeek-V3 (MLA, the bias update, MTP and its embedding copy on the last stage) in
    # 1F1B stages with CP and EP: tests/test_document_mask_train.py, with document masks.
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path):
    case = LAYOUTS[name]
    argv = case.model + case.layout
    if ZBV in argv and torch_release() < ZBV_EXACT_FROM:
        pytest.skip(f"ZBVZeroBubble is refused on torch {torch.__version__} (not exact there)")
    out_path = str(tmp_path / "out.pt")
    run_distributed(layout_worker, case.world, argv, out_path, case.routing, case.steps)
    out = torch.load(tmp_path / "out.pt")
    fp8 = ROWWISE in argv or TENSORWISE in argv
    ref = reference_run(
        argv, case.dp_size, case.routing, case.steps, out["records"] if fp8 else None
    )
    assert_same_training(out["records"], ref)
    nodes = any(a.startswith("--parallel.ranks_per_node=") for a in case.layout)
    if any(a.startswith("--parallel.ep=") for a in case.layout):
        # Flat: each remote assignment crosses once out (dispatch) and once back (combine),
        # in forward and in backward; summed over the ranks that send them. Across nodes:
        # each (token, remote node) pair instead (moetrain/parallelisms/node_dispatch.py).
        key = "a2a_internode" if nodes else "a2a"
        for step in range(len(out["records"])):
            sent = sum(rank[step][f"{key}_bytes"] for rank in out["per_rank"])
            expected = sum(rank[step][f"{key}_expected"] for rank in out["per_rank"])
            assert sent == expected > 0
    if "--peft.method=lora" in case.layout:
        _assert_frozen_base(argv, out["records"])
    if case.model is TINY_DSV3:  # the bias update acted, in 2 MoE layers (3 with L4) and MTP's
        bias = {n: b for n, b in ref[-1]["buffers"].items() if n.endswith("correction_bias")}
        routers = 4 if L4 in case.layout else 3
        assert len(bias) == routers and all(b.abs().max() > 0 for b in bias.values())


def _assert_frozen_base(argv: list[str], records: list[dict]) -> None:
    """Under LoRA the optimizer holds the adapters alone, and after training every base
    weight still has the bytes of a fresh init; the adapters moved."""
    cfg = load_config(argv)
    base = get_model_spec(cfg.model.name).build(cfg.model.args)
    base.init_weights(cfg.train.seed)
    last = records[-1]
    assert last["optimized"] == sorted(n for n in last["params"] if is_adapter(n))
    assert set(last["grads"]) == set(last["optimized"])  # no gradient for a frozen weight
    for name, value in base.named_parameters():
        assert torch.equal(last["params"][name], value), f"frozen {name} changed"
    moved = [n for n in last["optimized"] if n.endswith("lora_B") and last["params"][n].any()]
    assert len(moved) == len(last["optimized"]) // 2  # B left zero in every adapter

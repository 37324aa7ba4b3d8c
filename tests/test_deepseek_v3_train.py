"""DeepSeek-V3 training: the aux-loss-free bias update, the sequence-wise aux loss,
multi-token prediction, and checkpoints through the front door. (Its layouts against one
plain process are rows of tests/test_layout_parity.py.)"""

import math
import shutil

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from moetrain.data.batch import IGNORE_INDEX, Batch
from moetrain.loop.balance import BiasUpdate
from moetrain.loop.losses import with_mtp_targets
from moetrain.models.common.balance_losses import sequence_balance_loss, stack_stats
from moetrain.models.common.moe import GroupLimitedRouter, MoE
from moetrain.models.deepseek_v3.args import DeepseekV3Args
from moetrain.models.deepseek_v3.model import DeepseekV3ForCausalLM
from tests.distributed import run_train

# --- load balancing -----------------------------------------------------------------------


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def test_sequence_balance_loss_equals_its_formula_on_a_hand_made_batch():
    """L = sum_e f_e P_e per sequence, f_e = E / (K T) * #{t: e in top-K(t)}, P_e = mean_t
    s_e,t / sum_j s_j,t (sigmoid affinities), averaged over sequences: written out in
    plain Python against the router's own choices."""
    E, K, T = 4, 2, 3
    weight = [[1.0, 0.0], [0.0, 1.0], [-1.0, 0.5], [0.5, -1.0]]
    x = [[[1.0, 0.2], [0.3, 2.0], [-1.0, 0.1]], [[0.5, 0.5], [2.0, -1.0], [0.1, -0.3]]]
    router = GroupLimitedRouter(2, E, K, n_group=2, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=1.0)  # fmt: skip
    moe = MoE(2, 4, router)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(weight))
        for p in moe.experts.parameters():
            p.normal_()
    stats = stack_stats([moe(torch.tensor(x))[1]])  # one layer: [1, B, E]

    expected = 0.0
    for seq in x:
        scores = [[_sigmoid(sum(w * v for w, v in zip(row, tok))) for row in weight] for tok in seq]
        chosen = [sorted(range(E), key=lambda e, s=s: -s[e])[:K] for s in scores]
        f = [E / (K * T) * sum(e in c for c in chosen) for e in range(E)]
        p = [sum(s[e] / sum(s) for s in scores) / T for e in range(E)]
        expected += sum(fe * pe for fe, pe in zip(f, p)) / len(x)
    assert sequence_balance_loss(stats).item() / len(x) == pytest.approx(expected, rel=1e-6)

    # Split over two "context-parallel" parts: with the whole sequences' counts, the
    # parts' shares add up to the same value.
    head = stack_stats([moe(torch.tensor(x)[:, :2])[1]])
    tail = stack_stats([moe(torch.tensor(x)[:, 2:])[1]])
    counts = head.tokens_per_expert + tail.tokens_per_expert
    shares = sequence_balance_loss(head, counts, T) + sequence_balance_loss(tail, counts, T)
    assert shares.item() / len(x) == pytest.approx(expected, rel=1e-6)


def test_bias_update_moves_load_toward_balance():
    """Tokens that all lean towards experts 0 and 1: the bias update (the trainer's hook,
    here without a process group) brings max/mean load from 3 to near 1 (measured: 3.00 ->
    about 1.06, with a small oscillation the fixed sign step leaves)."""
    torch.manual_seed(0)
    router = GroupLimitedRouter(16, 8, 2, n_group=4, topk_group=2, norm_topk_prob=True,
                                routed_scaling_factor=1.0)  # fmt: skip
    lean = torch.randn(16)
    lean = 1.5 * lean / lean.norm()
    with torch.no_grad():
        router.weight.normal_(0, 0.3)
        router.weight[:2] += lean  # experts 0 and 1 score high on every token
    x = torch.randn(4096, 16) + lean
    update = BiasUpdate([router], rate=0.005)
    imbalance = []
    for _ in range(150):
        router(x)  # a training forward counts its assignments
        load = router.tokens_per_expert.float()
        imbalance.append((load.max() / load.mean()).item())
        update()
        assert router.tokens_per_expert.sum() == 0  # counts cleared after each update
    late = sum(imbalance[-20:]) / 20
    assert imbalance[0] > 2.5 and late < 1.25, (imbalance[0], imbalance[-20:])
    print(f"bias update: max/mean load {imbalance[0]:.2f} -> {late:.2f} (mean of last 20)")


# --- multi-token prediction ---------------------------------------------------------------


def _batch(input_ids: torch.Tensor, labels: torch.Tensor) -> Batch:
    zeros = torch.zeros_like(input_ids)
    return Batch(input_ids=input_ids, labels=labels, position_ids=zeros, document_ids=zeros)


def test_mtp_targets_shift_inputs_and_labels_by_each_depth():
    out = with_mtp_targets(_batch(torch.arange(6)[None], torch.arange(1, 7)[None]), depth=2)
    assert out.mtp_input_ids[0].T.tolist() == [[1, 2, 3, 4, 5, 0], [2, 3, 4, 5, 0, 0]]
    ignore = IGNORE_INDEX
    assert out.mtp_labels[0].T.tolist() == [
        [2, 3, 4, 5, 6, ignore],
        [3, 4, 5, 6, ignore, ignore],
    ]


def test_mtp_logits_at_position_i_see_tokens_up_to_i_plus_depth():
    """Depth k at position i reads tokens <= i + k: changing token j moves the main logits
    from position j on, depth 1's from j - 1 on, depth 2's from j - 2 on."""
    args = DeepseekV3Args(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        num_nextn_predict_layers=2, initializer_range=0.2,
    )  # fmt: skip
    model = DeepseekV3ForCausalLM(args).eval()
    model.init_weights(0)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    j = 7
    changed[0, j] = (ids[0, j] + 1) % 64
    outs = []
    with torch.no_grad():
        for tokens in (ids, changed):
            batch = with_mtp_targets(_batch(tokens, tokens), depth=2)
            outs.append(model(tokens, mtp_input_ids=batch.mtp_input_ids))
    for depth, (a, b) in enumerate(
        [(outs[0].logits, outs[1].logits)] + list(zip(outs[0].mtp_logits, outs[1].mtp_logits))
    ):
        first_moved = j - depth
        # (Not bit-equal: the experts' GEMMs see different token sets, so round-off moves.)
        torch.testing.assert_close(a[:, :first_moved], b[:, :first_moved], rtol=0, atol=1e-5)
        assert (a[:, first_moved] - b[:, first_moved]).abs().max() > 1e-2


# --- checkpoints through the front door ---------------------------------------------------

DEBUG = [
    "--config=configs/debug_deepseek_v3.toml",
    "--data.max_tokens=200000",
    "--data.seq_len=64",
    "--train.steps=4",
    "--train.warmup_steps=2",
    "--checkpoint.interval=2",
    "--moe.bias_update_rate=0.01",
    "--metrics.log_interval=1",
]


@pytest.mark.slow
def test_resume_on_another_layout_restores_the_routing_bias(tmp_path):
    """2 ranks (FSDP) for 4 steps vs the same run resumed at step 2 on 4 ranks with ep 2:
    same losses, because the checkpoint holds each router's bias (and its counts)."""
    straight = run_train(DEBUG, tmp_path / "straight", nproc=2)
    step2 = tmp_path / "straight" / "checkpoints" / "step-2"
    keys = FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    for layer in ("layers.1", "layers.3", "mtp.0.block"):
        assert f"model.{layer}.mlp.gate.e_score_correction_bias" in keys
        assert f"model.{layer}.mlp.gate.tokens_per_expert" in keys
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(step2, resumed_dir / "checkpoints" / "step-2")
    resumed = run_train(DEBUG + ["--parallel.ep=2"], resumed_dir, nproc=4)
    assert [r["step"] for r in resumed] == [3, 4]
    for ours, ref in zip(resumed, straight[2:], strict=True):
        assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert ours["mtp_loss"] == pytest.approx(ref["mtp_loss"], rel=1e-5)

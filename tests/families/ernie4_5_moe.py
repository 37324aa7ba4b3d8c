"""ERNIE-4.5 MoE's table for the model suite (tests/families/family.py)."""

from moetrain.config import load_config
from moetrain.models.ernie4_5_moe.args import Ernie45MoeArgs
from tests.families.family import ArgsProblems, Aux, Family, Flops, Layout, Refusal

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
# A config.json in the published dialect of the 21B-A3B's shape: a top-level rope_theta,
# the end index written out, and keys of Baidu's own code that transformers ignores.
PUBLISHED = {
    "architectures": ["Ernie4_5_MoeForCausalLM"],
    "model_type": "ernie4_5_moe",
    "hidden_act": "silu",
    "hidden_size": 2560,
    "intermediate_size": 12288,
    "max_position_embeddings": 131072,
    "num_attention_heads": 20,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "rms_norm_eps": 1e-05,
    "vocab_size": 103424,
    "rope_theta": 500000,
    "use_bias": False,
    "tie_word_embeddings": True,
    "moe_num_experts": 64,
    "moe_num_shared_experts": 2,
    "moe_k": 6,
    "moe_layer_start_index": 1,
    "moe_layer_end_index": 27,
    "moe_layer_interval": 1,
    "moe_intermediate_size": 1536,
    "router_aux_loss_coef": 0.001,
    "torch_dtype": "bfloat16",
    "moe_gate": "topk",
    "moe_use_aux_free": True,
    "num_nextn_predict_layers": 1,
}


def _resolved_end_index(args: Ernie45MoeArgs) -> int:
    end = args.moe_layer_end_index
    return args.num_hidden_layers - 1 if end == -1 else end


FAMILY = Family(
    name="ernie4_5_moe",
    hf_class="Ernie4_5_MoeForCausalLM",
    hf_config_class="Ernie4_5_MoeConfig",
    base=dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,  # 4 x 16 = 64: not hidden_size / heads
        moe_num_experts=8,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        router_aux_loss_coef=0.01,
        initializer_range=0.2,  # larger than default so routing and attention are not flat
    ),
    cases={
        # layers 1..3 of 5 MoE (0 by the start index, 4 by the end index), 2 shared experts,
        # biases everywhere, an untied head with its bias
        "start1_end3_shared2_bias_untied": dict(
            num_hidden_layers=5,
            moe_layer_start_index=1,
            moe_layer_end_index=3,
            moe_num_shared_experts=2,
            use_bias=True,
            tie_word_embeddings=False,
            moe_k=2,
        ),
        # every 2nd layer MoE (1 and 3; 0 and 2 dense), no shared experts, no biases, a tied
        # head, top-3
        "interval2_noshared_tied": dict(
            num_hidden_layers=4,
            moe_layer_start_index=0,
            moe_layer_interval=2,
            moe_num_shared_experts=0,
            use_bias=False,
            tie_word_embeddings=True,
            moe_k=3,
        ),
        # every layer MoE, 1 shared expert, a tied head that keeps its own bias, YaRN
        "all_moe_shared1_tied_bias_yarn": dict(
            num_hidden_layers=3,
            moe_layer_start_index=0,
            moe_num_shared_experts=1,
            use_bias=True,
            tie_word_embeddings=True,
            moe_k=2,
            rope=YARN,
        ),
    },
    moe_layers={
        "start1_end3_shared2_bias_untied": [1, 2, 3],
        "interval2_noshared_tied": [1, 3],
        "all_moe_shared1_tied_bias_yarn": [0, 1, 2],
    },
    # transformers writes the end index resolved (-1 -> the last layer): the same layers
    resolved_on_save={"moe_layer_end_index": _resolved_end_index},
    published=PUBLISHED,
    published_args=lambda: load_config(["--config=configs/ernie4_5_21b_a3b.toml"]).model.args,
    absent_keys=({"model_type": "ernie4_5_moe"}, {"rope_theta": 500000.0}),
    aux=Aux.POOLED_UNBIASED_TOPK,
    # The routing biases are the size of the probabilities' spread (1/8 on average), so
    # they change which experts are chosen.
    correction_bias_std=0.1,
    position_offset=3000,  # past YaRN's original 1024
    packed_case="start1_end3_shared2_bias_untied",
    expert_width_field="moe_intermediate_size",
    # a tied head holding only its bias: the input embedding counts as the head's matmul
    flops=Flops(
        "all_moe_shared1_tied_bias_yarn", attention=6 * 3 * 4 * (16 + 16) * 64, aux_loss_coef=0.01
    ),
    refusals={
        "model_type": Refusal(
            dict(model_type="qwen3_moe"), "model_type 'qwen3_moe', expected 'ernie4_5_moe'"
        ),
        "hidden_act": Refusal(dict(hidden_act="gelu"), "hidden_act 'gelu'; only 'silu'"),
        "linear_rope": Refusal(
            dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling .*'linear'.*remove"
        ),
        "top_k": Refusal(
            dict(moe_k=65), r"model.moe_k \(65\) must be <= model.moe_num_experts \(64\)"
        ),
        "kv_heads": Refusal(
            dict(num_key_value_heads=3), r"num_attention_heads \(20\) must be a multiple"
        ),
        "end_index": Refusal(
            dict(moe_layer_end_index=-2), "model.moe_layer_end_index must be >= -1"
        ),
    },
    bounds={
        "end_index": ArgsProblems(
            dict(moe_layer_end_index=-2), ("model.moe_layer_end_index must be >= -1",)
        ),
    },
    cross_field={
        "top_k": ArgsProblems(
            dict(moe_k=65), ("model.moe_k (65) must be <= model.moe_num_experts",)
        ),
        "odd_head_dim": ArgsProblems(dict(head_dim=127), ("model.head_dim must be even for RoPE",)),
    },
    # Adam's first update is ~lr * g / (|g| + eps): a larger eps keeps round-off in a
    # near-zero gradient from becoming an lr-sized difference (docs/models.md, "When layouts
    # agree within 1e-5").
    train_argv=(
        "--train.steps=3",
        "--train.warmup_steps=1",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=2",
        "--data.seq_len=64",  # 4 zigzag chunks of 16 at cp 2
        "--data.max_tokens=200000",
        "--train.eps=1e-4",
    ),
    # two pipeline stages (the last with its copy of the tied embedding), each over cp 2
    # with ep 2 borrowing the cp ranks
    layouts={
        "pp2_cp2_ep2": Layout(4, ("--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=2")),
    },
)

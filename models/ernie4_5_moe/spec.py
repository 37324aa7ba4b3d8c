from models.common.flops import training_flops_per_token
from models.common.plan import ParallelPlan
from models.ernie4_5_moe import hf
from models.ernie4_5_moe.args import Ernie45MoeArgs
from models.ernie4_5_moe.model import Ernie45MoeForCausalLM
from models.spec import ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    shared_experts="layers.*.mlp.shared_experts",
    fp32_modules=("layers.*.mlp.gate",),
    # A tied head without a bias builds no lm_head; moe_num_shared_experts = 0 no shared experts.
    optional=("lm_head", "layers.*.mlp.shared_experts"),
)


def flops_per_token(model: Ernie45MoeForCausalLM, seq_len: int) -> float:
    """The derived count but for the tied head: with `use_bias` a tied head still builds an
    `lm_head` (holding only the bias), so "lm_head is None" does not say "tied" here."""
    a = model.args
    return training_flops_per_token(
        model,
        seq_len,
        attention_layers=a.num_hidden_layers,
        heads=a.num_attention_heads,
        qk_dim=a.head_dim,
        v_dim=a.head_dim,
        # Tied: the one matrix is the head's matmul (a tied head's bias is not a matmul).
        input_embedding=None if a.tie_word_embeddings else model.embed_tokens,
    )


SPEC = ModelSpec(
    name="ernie4_5_moe",
    args_cls=Ernie45MoeArgs,
    model_cls=Ernie45MoeForCausalLM,
    plan=PLAN,
    flops_per_token=flops_per_token,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

from models.common.flops import training_flops_per_token
from models.common.plan import ParallelPlan
from models.glm4_moe import hf
from models.glm4_moe.args import Glm4MoeArgs
from models.glm4_moe.model import Glm4MoeForCausalLM
from models.spec import LossTerms, ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    shared_experts="layers.*.mlp.shared_experts",
    fp32_modules=("layers.*.mlp.gate",),  # the routers: sigmoid scores and correction bias
    optional=("lm_head", "layers.*.mlp.shared_experts"),  # a tied head; n_shared_experts = 0
)


def loss_terms(args: Glm4MoeArgs) -> LossTerms:
    return LossTerms(aux_loss_coef=args.router_aux_loss_coef)


def flops_per_token(model: Glm4MoeForCausalLM, seq_len: int) -> float:
    """Partial rotary changes no matmul: queries and keys stay head_dim wide."""
    a = model.args
    return training_flops_per_token(
        model,
        seq_len,
        attention_layers=a.num_hidden_layers,
        heads=a.num_attention_heads,
        qk_dim=a.head_dim,
        v_dim=a.head_dim,
        input_embedding=model.embed_tokens if model.lm_head is not None else None,
    )


SPEC = ModelSpec(
    name="glm4_moe",
    args_cls=Glm4MoeArgs,
    model_cls=Glm4MoeForCausalLM,
    plan=PLAN,
    loss_terms=loss_terms,
    flops_per_token=flops_per_token,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

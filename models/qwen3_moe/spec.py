from models.common.flops import training_flops_per_token
from models.common.plan import ParallelPlan
from models.qwen3_moe import hf
from models.qwen3_moe.args import Qwen3MoeArgs
from models.qwen3_moe.model import Qwen3MoeForCausalLM
from models.spec import LossTerms, ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    fp32_modules=("layers.*.mlp.gate",),
)


def loss_terms(args: Qwen3MoeArgs) -> LossTerms:
    return LossTerms(aux_loss_coef=args.router_aux_loss_coef)


def flops_per_token(model: Qwen3MoeForCausalLM, seq_len: int) -> float:
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
    name="qwen3_moe",
    args_cls=Qwen3MoeArgs,
    model_cls=Qwen3MoeForCausalLM,
    plan=PLAN,
    loss_terms=loss_terms,
    flops_per_token=flops_per_token,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

"""OLMoE (allenai/OLMoE-1B-7B-0924 and its family): the model's contract with the trainer."""

from models.common.flops import training_flops_per_token
from models.common.plan import ParallelPlan
from models.olmoe import hf
from models.olmoe.args import OlmoeArgs
from models.olmoe.model import OlmoeForCausalLM
from models.spec import LossTerms, ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    fp32_modules=("layers.*.mlp.gate",),  # the router: softmax top-k in fp32
)


def loss_terms(args: OlmoeArgs) -> LossTerms:
    return LossTerms(aux_loss_coef=args.router_aux_loss_coef)


def flops_per_token(model: OlmoeForCausalLM, seq_len: int) -> float:
    a = model.args
    return training_flops_per_token(
        model,
        seq_len,
        attention_layers=a.num_hidden_layers,
        heads=a.num_attention_heads,
        qk_dim=a.resolved_head_dim,
        v_dim=a.resolved_head_dim,
        input_embedding=model.embed_tokens if model.lm_head is not None else None,
    )


SPEC = ModelSpec(
    name="olmoe",
    args_cls=OlmoeArgs,
    model_cls=OlmoeForCausalLM,
    plan=PLAN,
    loss_terms=loss_terms,
    flops_per_token=flops_per_token,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

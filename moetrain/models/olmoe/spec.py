"""OLMoE (allenai/OLMoE-1B-7B-0924 and its family): the model's contract with the trainer."""

from moetrain.models.common.plan import ParallelPlan
from moetrain.models.olmoe import hf
from moetrain.models.olmoe.args import OlmoeArgs
from moetrain.models.olmoe.model import OlmoeForCausalLM
from moetrain.models.spec import AttentionShape, ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    fp32_modules=("layers.*.mlp.gate",),  # the router: softmax top-k in fp32
)


SPEC = ModelSpec(
    name="olmoe",
    args_cls=OlmoeArgs,
    model_cls=OlmoeForCausalLM,
    plan=PLAN,
    # head_dim may be unset (None): the width the model uses is resolved_head_dim.
    attention=AttentionShape(qk_dim="resolved_head_dim", v_dim="resolved_head_dim"),
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

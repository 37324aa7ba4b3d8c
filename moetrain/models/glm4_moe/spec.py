from moetrain.models.common.plan import ParallelPlan
from moetrain.models.glm4_moe import hf
from moetrain.models.glm4_moe.args import Glm4MoeArgs
from moetrain.models.glm4_moe.model import Glm4MoeForCausalLM
from moetrain.models.spec import ModelSpec

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
# The FLOPs are the derived count: partial rotary changes no matmul (queries and keys stay
# head_dim wide).


SPEC = ModelSpec(
    name="glm4_moe",
    args_cls=Glm4MoeArgs,
    model_cls=Glm4MoeForCausalLM,
    plan=PLAN,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

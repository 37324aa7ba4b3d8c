from moetrain.models.common.plan import ParallelPlan
from moetrain.models.ernie4_5_moe import hf
from moetrain.models.ernie4_5_moe.args import Ernie45MoeArgs
from moetrain.models.ernie4_5_moe.model import Ernie45MoeForCausalLM
from moetrain.models.spec import ModelSpec

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


SPEC = ModelSpec(
    name="ernie4_5_moe",
    args_cls=Ernie45MoeArgs,
    model_cls=Ernie45MoeForCausalLM,
    plan=PLAN,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

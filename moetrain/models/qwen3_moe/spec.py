from moetrain.models.common.plan import ParallelPlan
from moetrain.models.qwen3_moe import hf
from moetrain.models.qwen3_moe.args import Qwen3MoeArgs
from moetrain.models.qwen3_moe.model import Qwen3MoeForCausalLM
from moetrain.models.spec import ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    fp32_modules=("layers.*.mlp.gate",),
)


SPEC = ModelSpec(
    name="qwen3_moe",
    args_cls=Qwen3MoeArgs,
    model_cls=Qwen3MoeForCausalLM,
    plan=PLAN,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

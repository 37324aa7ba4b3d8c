"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the model's contract with the trainer."""

from moetrain.models.common.plan import ParallelPlan
from moetrain.models.qwen2_moe import hf
from moetrain.models.qwen2_moe.args import Qwen2MoeArgs
from moetrain.models.qwen2_moe.model import Qwen2MoeForCausalLM
from moetrain.models.spec import ModelSpec

# Dense layers (mlp_only_layers, decoder_sparse_step > 1) have no experts, gate or shared
# expert under `mlp`: the MoE patterns skip them.
PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    shared_experts="layers.*.mlp.shared_experts",
    fp32_modules=("layers.*.mlp.gate",),  # the router: softmax top-k in fp32
)


SPEC = ModelSpec(
    name="qwen2_moe",
    args_cls=Qwen2MoeArgs,
    model_cls=Qwen2MoeForCausalLM,
    plan=PLAN,
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

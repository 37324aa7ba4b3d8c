from models import ModelSpec
from models.common.plan import ParallelPlan
from models.qwen3_moe import hf
from models.qwen3_moe.args import Qwen3MoeArgs
from models.qwen3_moe.model import Qwen3MoeForCausalLM

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    attention_core="layers.*.self_attn.core",
    fp32_modules=("layers.*.mlp.gate",),
)

SPEC = ModelSpec(
    name="qwen3_moe", args_cls=Qwen3MoeArgs, model_cls=Qwen3MoeForCausalLM, plan=PLAN, hf_adapter=hf
)

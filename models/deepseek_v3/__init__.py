from models import ModelSpec
from models.common.plan import ParallelPlan
from models.deepseek_v3 import hf
from models.deepseek_v3.args import DeepseekV3Args
from models.deepseek_v3.model import DeepseekV3ForCausalLM

# The MTP modules (when built) are blocks too: their own FSDP units, prefetched after the
# last decoder block, with their experts under EP and their attention on the ring.
PLAN = ParallelPlan(
    blocks=("layers.*", "mtp.*"),
    routed_experts=("layers.*.mlp.experts", "mtp.*.block.mlp.experts"),
    attention_core=("layers.*.self_attn.core", "mtp.*.block.self_attn.core"),
    fp32_modules=("layers.*.mlp.gate", "mtp.*.block.mlp.gate"),
)

SPEC = ModelSpec(
    name="deepseek_v3",
    args_cls=DeepseekV3Args,
    model_cls=DeepseekV3ForCausalLM,
    plan=PLAN,
    hf_adapter=hf,
)

"""GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b): the model's contract with the trainer.

Its attention variants (a sliding window on the layers `layer_types` marks, a sink per head)
are stated by the model itself, on each layer's `AttentionCore`; the plan needs nothing more:
context parallelism carries them onto the ring.
"""

from moetrain.models.common.plan import ParallelPlan
from moetrain.models.gpt_oss import hf
from moetrain.models.gpt_oss.args import GptOssArgs
from moetrain.models.gpt_oss.model import GptOssForCausalLM
from moetrain.models.spec import AttentionShape, ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    fp32_modules=("layers.*.mlp.gate",),  # the router: top-k in fp32
)


def attention_layers(a: GptOssArgs, seq_len: int) -> float:
    """A sliding-window layer's queries see at most `sliding_window` keys."""
    sliding = sum(a.layer_type(i) == "sliding_attention" for i in range(a.num_hidden_layers))
    return a.num_hidden_layers - sliding + sliding * min(a.sliding_window, seq_len) / seq_len


SPEC = ModelSpec(
    name="gpt_oss",
    args_cls=GptOssArgs,
    model_cls=GptOssForCausalLM,
    plan=PLAN,
    attention=AttentionShape(layers=attention_layers, sinks=True),
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

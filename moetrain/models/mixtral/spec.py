"""Mixtral (mistralai/Mixtral-8x7B-v0.1 and its family): the model's contract with the trainer.

Its sliding window, when set, is stated by the model on each layer's `AttentionCore`; the
plan needs nothing more: context parallelism carries it onto the ring.
"""

from moetrain.models.common.plan import ParallelPlan
from moetrain.models.mixtral import hf
from moetrain.models.mixtral.args import MixtralArgs
from moetrain.models.mixtral.model import MixtralForCausalLM
from moetrain.models.spec import AttentionShape, ModelSpec

PLAN = ParallelPlan(
    blocks="layers.*",
    routed_experts="layers.*.mlp.experts",
    routed_permute="layers.*.mlp.permute",
    routed_sum="layers.*.mlp.unpermute",
    attention_core="layers.*.self_attn.core",
    fp32_modules=("layers.*.mlp.gate",),  # the router: softmax top-k in fp32
)


def attention_layers(a: MixtralArgs, seq_len: int) -> float:
    """A sliding-window query sees at most `sliding_window` keys: count that share of the
    scores, as for GPT-OSS."""
    window = a.sliding_window if a.sliding_window is not None else seq_len
    return a.num_hidden_layers * min(window, seq_len) / seq_len


SPEC = ModelSpec(
    name="mixtral",
    args_cls=MixtralArgs,
    model_cls=MixtralForCausalLM,
    plan=PLAN,
    attention=AttentionShape(layers=attention_layers),
    hf_adapter=hf,
    training_fields=("router_aux_loss_coef",),
    max_positions=lambda args: args.max_position_embeddings,
)

from moetrain.models.common.flops import with_head_passes
from moetrain.models.common.plan import ParallelPlan
from moetrain.models.deepseek_v3 import hf
from moetrain.models.deepseek_v3.args import DeepseekV3Args
from moetrain.models.deepseek_v3.model import DeepseekV3ForCausalLM
from moetrain.models.spec import AttentionShape, LossTerms, ModelSpec, derived_flops_per_token

# The MTP modules (when built) are blocks too: their own FSDP units, prefetched after the
# last decoder block, with their experts under EP and their attention on the ring.
PLAN = ParallelPlan(
    blocks=("layers.*", "mtp.*"),
    routed_experts=("layers.*.mlp.experts", "mtp.*.block.mlp.experts"),
    routed_permute=("layers.*.mlp.permute", "mtp.*.block.mlp.permute"),
    routed_sum=("layers.*.mlp.unpermute", "mtp.*.block.mlp.unpermute"),
    attention_core=("layers.*.self_attn.core", "mtp.*.block.self_attn.core"),
    shared_experts=("layers.*.mlp.shared_experts", "mtp.*.block.mlp.shared_experts"),
    fp32_modules=("layers.*.mlp.gate", "mtp.*.block.mlp.gate"),
    head=("norm", "lm_head", "mtp"),
    # A tied head; no MTP modules (num_nextn_predict_layers=0); no shared experts (0 of them).
    optional=("lm_head", "mtp", "layers.*.mlp.shared_experts", "mtp.*.block.mlp.shared_experts"),
)


def loss_terms(args: DeepseekV3Args) -> LossTerms:
    return LossTerms(
        aux_loss_coef=args.router_aux_loss_coef,
        mtp_depth=args.num_nextn_predict_layers,
        mtp_weight=args.mtp_loss_weight,
    )


# MLA: queries and keys are qk_head_dim wide, values v_head_dim; each MTP depth is one more
# attention layer.
ATTENTION = AttentionShape(
    layers=lambda a, _seq_len: a.num_hidden_layers + a.num_nextn_predict_layers,
    qk_dim="qk_head_dim",
    v_dim="v_head_dim",
)


def flops_per_token(model: DeepseekV3ForCausalLM, seq_len: int) -> float:
    """The derived count, plus each MTP depth's second pass through the shared output head
    (its parameters count once in the derived count)."""
    depths = len(model.mtp) if model.mtp is not None else 0
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    return with_head_passes(derived_flops_per_token(ATTENTION, model, seq_len), head, depths)


SPEC = ModelSpec(
    name="deepseek_v3",
    args_cls=DeepseekV3Args,
    model_cls=DeepseekV3ForCausalLM,
    plan=PLAN,
    loss_terms=loss_terms,
    attention=ATTENTION,
    flops_per_token=flops_per_token,
    hf_adapter=hf,
    training_fields=(
        "router_aux_loss_coef",
        "mtp_loss_weight",
        "num_nextn_predict_layers",  # MTP is opt-in; HF configs say 1 with or without weights
    ),
    max_positions=lambda args: args.max_position_embeddings,
    routing_groups=lambda args: (args.n_group, args.topk_group),
)

from models.common.flops import training_flops_per_token, with_head_passes
from models.common.plan import ParallelPlan
from models.deepseek_v3 import hf
from models.deepseek_v3.args import DeepseekV3Args
from models.deepseek_v3.model import DeepseekV3ForCausalLM
from models.spec import LossTerms, ModelSpec

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


def flops_per_token(model: DeepseekV3ForCausalLM, seq_len: int) -> float:
    a = model.args
    flops = training_flops_per_token(
        model,
        seq_len,
        attention_layers=a.num_hidden_layers + a.num_nextn_predict_layers,
        heads=a.num_attention_heads,
        qk_dim=a.qk_head_dim,
        v_dim=a.v_head_dim,
        input_embedding=model.embed_tokens if model.lm_head is not None else None,
    )
    # each MTP depth runs the shared output head once more (its parameters count once above)
    depths = len(model.mtp) if model.mtp is not None else 0
    head = model.lm_head if model.lm_head is not None else model.embed_tokens
    return with_head_passes(flops, head, depths)


SPEC = ModelSpec(
    name="deepseek_v3",
    args_cls=DeepseekV3Args,
    model_cls=DeepseekV3ForCausalLM,
    plan=PLAN,
    loss_terms=loss_terms,
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

"""The model contract: everything the trainer, export and tests may ask of a model.

A model folder exports one `SPEC = ModelSpec(...)`. The trainer reads a model only
through it: it never looks up a hyper-parameter or a submodule by name. The pieces:

- `args_cls`: a dataclass of hyper-parameters; its fields are the `[model]` keys. Make
  each with `moetrain.models.common.args.arg(default, doc, ge=/gt=/le=/lt=/choices=)`: the bounds
  are checked generically (`field_problems`) and shown by `--help`. A field typed
  `X | None` is optional (TOML: leave it out; command line: `none`). An optional
  `validate() -> list[str]` reports cross-field problems, one message each naming
  `model.<key>`; it runs only when every field is within its bounds. Every args class
  has `vocab_size` (the tokenizer's ids must fit). Defaults should be the published
  model's, and a key that config.json may omit should default as transformers does:
  with `model.init_from_hf`, a job-config value that differs from the default must equal
  config.json's.
- `build(args, moe_options)`: the one constructor signature, `model_cls(args,
  moe_options)`, used by the trainer (on the meta device), export and the tests.
- the built module (`CausalLM` below): plain PyTorch, mesh-agnostic. Share a tied
  embedding by using `embed_tokens.weight` in the head's matmul, not by sharing one
  Parameter between two modules (meta-device materialisation would untie them).
- attention variants: stated per layer on the model's own `AttentionCore` (a sliding
  `window`, and `sinks [Hq]` passed with each call), never as keys the trainer reads;
  context parallelism takes them from the core it replaces (`moetrain/models/gpt_oss/`).
- pipeline stages: the model's forward is its parts composed (`moetrain.models.common.staged`):
  `embed(input_ids) -> h`, `block_inputs(h, position_ids, document_ids)` (what each
  block takes after h, computed on every stage from those inputs alone), the plan's
  blocks `h, stats = block(h, *block_inputs)`, and `head(h, block_inputs, mtp_input_ids)`
  (final norm, output head, MTP). A stage runs a slice of them: hidden states in, hidden
  states out. `moetrain.models.common.decoder.DecoderLM` gives all four for an
  embed_tokens/layers/norm/lm_head model with RoPE; the plan's `embedding` and `head`
  name the modules the first and the last part use.
- `plan`: the declarative `ParallelPlan` (blocks, routed experts, attention cores, the
  embedding and head modules).
- `loss_terms(args)`: what the loss adds to the token cross-entropy (`LossTerms`). By
  default derived: the aux coefficient is the args field `aux_loss_field` names; a model
  with more terms (DeepSeek-V3's MTP) passes its own.
- `flops_per_token(model, seq_len)`: training FLOPs per token, for MFU. By default derived:
  `moetrain.models.common.flops.training_flops_per_token` with the attention shape read from the
  args fields `attention` names (`AttentionShape`), which discounts the routed experts of
  `moetrain.models.common.moe.MoE` layers; a model passes its own only where its count differs (a
  model with an MoE layer of its own discounts its own).
- `bias_buffers`: the buffer names by which a router takes part in the aux-loss-free bias
  update (`BiasBuffers`); the trainer finds routers by them, never by class.
- `training_fields`: `[model]` keys that steer training, not the architecture; with
  `model.init_from_hf` they come from the job config, never from config.json.
- `hf_adapter`: the Hugging Face checkpoint mapping (`HFAdapter`), or None.
- `max_positions(args)`: the longest sequence the model is meant for (a longer
  `data.seq_len` is refused), or None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from moetrain.models.common.flops import training_flops_per_token
from moetrain.models.common.moe import MoEOptions
from moetrain.models.common.output import CausalLMOutput
from moetrain.models.common.plan import ParallelPlan

# has(key): whether the checkpoint holds tensor `key`.
HasKey = Callable[[str], bool]
# get(key, index): the part `index` (a slice per dim) of checkpoint tensor `key`, read from
# disk without the rest; index None reads all of it.
GetSlice = Callable[[str, "tuple[slice, ...] | None"], torch.Tensor]


class CausalLM(Protocol):
    """What the trainer calls on a built model (an `nn.Module`)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        **inputs: Any,
    ) -> CausalLMOutput:
        """input_ids [B, S] -> logits [B, S, V] and routing statistics. position_ids [B, S]
        are the true positions (a context-parallel rank holds a reordered part).
        document_ids [B, S] (`data.document_mask`; None otherwise): the packed document of
        each token; the model passes them to every `AttentionCore` call (main blocks and
        MTP blocks alike), which then lets a token attend only to earlier tokens of its own
        document. A model with `LossTerms.mtp_depth = D > 0` takes `mtp_input_ids`
        [B, S, D] (depth k's input at position i is token i+k) and returns D MTP logits;
        the trainer passes no other keyword."""
        ...

    def reset_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None
    ) -> None:
        """Fill `tensor`, the full unsharded value of parameter or buffer `name`, with its
        initial value, drawing random numbers only from `generator`. The trainer calls
        it once per tensor with a layout-independent generator."""
        ...

    def init_weights(self, seed: int = 0) -> None:
        """Initialise the whole (unsharded) model from `seed`, as the trainer would: for
        single-process use (tests, references)."""
        ...


class HFAdapter(Protocol):
    """Hugging Face checkpoint <-> native model, by parameter name (a module or object).

    Native names are those of `model.named_parameters()` and `named_buffers()`. Every
    function is pure: file I/O and sharding are `moetrain.hf.weights`'s business.
    """

    def load_hf_config(self, model_dir: str) -> Any:
        """The model's args from `<model_dir>/config.json`; raises `moetrain.models.HFFormatError`
        (naming the key and the fix) for a config this model cannot represent."""
        ...

    def hf_config_dict(self, args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json content that transformers reads back into the same architecture;
        raises `moetrain.models.HFFormatError` for args transformers cannot represent (export is
        refused before any weight is written)."""
        ...

    def hf_keys(
        self, name: str, shape: tuple[int, ...], args: Any, has: HasKey
    ) -> dict[str, tuple[int, ...]]:
        """The checkpoint keys that make native tensor `name` (global `shape`), each with
        the shape it must have: checked against the file before any data is read."""
        ...

    def from_hf(
        self, name: str, args: Any, has: HasKey, get: GetSlice, index: tuple[slice, ...]
    ) -> torch.Tensor:
        """The part `index` of native tensor `name`, read through `get` so that each rank
        reads only what it holds."""
        ...

    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> dict[str, torch.Tensor]:
        """Checkpoint entries for the full value of native tensor `name` (may be several,
        e.g. one per expert; may be none, for state with no HF counterpart)."""
        ...

    def is_redundant_key(self, key: str, args: Any, has: HasKey) -> bool:
        """Whether checkpoint key `key`, which no native tensor reads, may be ignored (e.g.
        a tied head written anyway); any other unread key is refused."""
        ...


@dataclass(frozen=True)
class LossTerms:
    """What a model's training loss adds to the mean token cross-entropy."""

    # Weight of the load-balancing loss of the routers' statistics (moe.aux_loss_mode
    # picks which loss); 0 = off.
    aux_loss_coef: float = 0.0
    # Multi-token prediction depths D: the model takes `mtp_input_ids` and returns D logits.
    mtp_depth: int = 0
    # Weight of the mean over the D depths of each depth's mean token cross-entropy.
    mtp_weight: float = 0.0


@dataclass(frozen=True)
class AttentionShape:
    """Where the default `flops_per_token` (and the check of an attention kernel before
    launch) reads the attention's shape: args field names.

    `layers` is a field name, or (args, seq_len) -> the attention layers a token's scores
    cost, for a count that is not one field (a sliding-window layer counts
    min(window, seq_len) / seq_len of one; MTP blocks add theirs). `sinks`: the model passes
    trained sinks [Hq] to its attention cores (GPT-OSS), which a kernel must train too."""

    layers: str | Callable[[Any, int], float] = "num_hidden_layers"
    heads: str = "num_attention_heads"
    qk_dim: str = "head_dim"
    v_dim: str = "head_dim"
    sinks: bool = False


def derived_flops_per_token(shape: AttentionShape, model: nn.Module, seq_len: int) -> float:
    """`training_flops_per_token` with the attention shape `shape` names, read from
    `model.args`; the input embedding (`embed_tokens`, a lookup) is left out unless it is the
    head's matmul: tied, the head holds no weight of its own (`lm_head` None,
    `moetrain.models.common.decoder.DecoderLM`, or a head holding only a bias)."""
    a, layers = model.args, shape.layers
    return training_flops_per_token(
        model,
        seq_len,
        attention_layers=getattr(a, layers) if isinstance(layers, str) else layers(a, seq_len),
        heads=getattr(a, shape.heads),
        qk_dim=getattr(a, shape.qk_dim),
        v_dim=getattr(a, shape.v_dim),
        input_embedding=model.embed_tokens if hasattr(model.lm_head, "weight") else None,
    )


@dataclass(frozen=True)
class BiasBuffers:
    """The buffers by which a router takes part in the aux-loss-free bias update
    (`moetrain.loop.balance`): a module that registers both is updated, whatever its class.

    `bias` [E] fp32: added to the scores for the choice of experts only; `counts` [E] int64:
    the assignments of its training forwards since the last update (a replayed forward,
    `moetrain.models.common.replay`, counts nothing). The update moves `bias` against the load the
    counts give, summed over the global batch, and clears `counts`."""

    bias: str = "e_score_correction_bias"
    counts: str = "tokens_per_expert"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args_cls: type  # dataclass of hyper-parameters: its fields are the `[model]` keys
    # The constructor: model_cls(args, moe_options) -> an nn.Module that is a CausalLM.
    model_cls: Callable[[Any, MoEOptions], nn.Module]
    plan: ParallelPlan
    # args -> LossTerms; None: derived (the aux coefficient from `aux_loss_field`).
    loss_terms: Callable[[Any], LossTerms] | None = None
    # (model, seq_len) -> training FLOPs per token; None: derived (`AttentionShape`).
    flops_per_token: Callable[[nn.Module, int], float] | None = None
    hf_adapter: HFAdapter | None = None
    training_fields: tuple[str, ...] = ()
    # The longest sequence the model is meant for (args -> positions), e.g. from
    # max_position_embeddings; a longer data.seq_len is refused. None: no limit.
    max_positions: Callable[[Any], int] | None = None
    # The args field holding the weight of the load-balancing loss (None: the model has none).
    aux_loss_field: str | None = "router_aux_loss_coef"
    # The args fields of the attention shape, for the derived `flops_per_token`.
    attention: AttentionShape = AttentionShape()
    # The routers' buffers for the aux-loss-free bias update.
    bias_buffers: BiasBuffers = BiasBuffers()

    # The routing's node bound: args -> (expert groups, groups one token's experts come
    # from), for group-limited routing (DeepSeek-V3: 8 groups, 4 per token; groups are runs
    # of consecutive experts). The planner's inter-node all-to-all counts a token's remote
    # nodes from it (`moetrain.planner.a2a_cost.node_share`). None: routing over all experts.
    routing_groups: Callable[[Any], tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        # NOTE: the derived defaults are filled in as the fields themselves, so every caller
        # reads `spec.loss_terms(args)` and `spec.flops_per_token(model, seq)` alike. A
        # derived default of another spec (what `dataclasses.replace` copies) is bound anew,
        # so that it reads this spec's `aux_loss_field` and `attention`.
        derived = {
            "loss_terms": ModelSpec._derived_loss_terms,
            "flops_per_token": ModelSpec._derived_flops_per_token,
        }
        for name, method in derived.items():
            given = getattr(self, name)
            if given is None or getattr(given, "__func__", None) is method:
                object.__setattr__(self, name, method.__get__(self))

    def _derived_loss_terms(self, args: Any) -> LossTerms:
        """The aux coefficient from `aux_loss_field`; no MTP."""
        if self.aux_loss_field is None:
            return LossTerms()
        return LossTerms(aux_loss_coef=getattr(args, self.aux_loss_field))

    def _derived_flops_per_token(self, model: nn.Module, seq_len: int) -> float:
        """`training_flops_per_token` with the shape `attention` names, read from
        `model.args`; the input embedding (`embed_tokens`) is left out unless the head is
        tied to it (`lm_head` None, `moetrain.models.common.decoder.DecoderLM`)."""
        return derived_flops_per_token(self.attention, model, seq_len)

    def build(self, args: Any, moe_options: MoEOptions | None = None) -> nn.Module:
        """The model of `args` (on the current default device; use `torch.device("meta")`
        to build without memory)."""
        return self.model_cls(args, moe_options or MoEOptions())

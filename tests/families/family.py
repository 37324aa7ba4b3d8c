"""What a model family gives the model suite (tests/test_models.py and its two siblings): one
typed table. A new model adds one `Family` under tests/families/ and one line in
tests/families/__init__.py; the common tests then cover it.

The tiny configs are written as transformers' config classes take them (keys as config.json
spells them): `rope` holds a case's `rope_parameters` without the theta, `rope_theta` the
theta. `native_args` turns the same dict into our args dataclass independently of the
adapter, so that reading a checkpoint is checked against what it should give.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn


class Aux(enum.Enum):
    """What transformers' aux loss of the family is comparable to."""

    # `aux_loss` of transformers' output with output_router_logits: our pooled
    # load_balancing_loss (moe.aux_loss_layers = "pooled"), and its `loss` is CE + coef * aux.
    POOLED = "pooled"
    # The same, while a correction bias steers the choice of experts: transformers counts the
    # top-k of the unbiased probabilities, so ours must count those, not the experts chosen.
    POOLED_UNBIASED_TOPK = "pooled_unbiased_topk"
    # transformers computes none: its `loss` is the cross-entropy alone.
    NONE = "none"


class Refusal(NamedTuple):
    """A change to the published config.json that the adapter's reader refuses with an
    `HFFormatError` whose message matches `match` (a regex naming the key and the fix)."""

    change: dict[str, Any]
    match: str


class ArgsProblems(NamedTuple):
    """Args built from `overrides` and the messages expected: as many messages, each
    holding its substring (out of bounds: in any order; across fields: in `validate()`'s
    order; an empty tuple: none)."""

    overrides: dict[str, Any]
    expected: tuple[str, ...]


class Layout(NamedTuple):
    """A parallel layout of the family's debug config: ranks and train.py arguments."""

    world: int
    argv: tuple[str, ...]


class Flops(NamedTuple):
    """flops_per_token at sequence 64 of the case `case`: 6 x the active parameters plus
    `attention`, the attention's score and value FLOPs worked out by hand for the case; and
    the aux-loss coefficient its loss terms carry."""

    case: str
    attention: float
    aux_loss_coef: float


# The layout check's train.py arguments, shared by the families checked on 2 ranks.
TRAIN_ARGV = (
    "--train.steps=3",
    "--train.warmup_steps=1",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=2",
    "--data.seq_len=64",  # 4 zigzag chunks of 16 at cp 2
    "--data.max_tokens=200000",
)
EP2, CP2 = "--parallel.ep=2", "--parallel.cp=2"
# plain FSDP, EP 2, CP 2, CP 2 x EP 2 (EP borrows the cp ranks)
TWO_RANK_LAYOUTS = {
    "fsdp2": Layout(2, ()),
    "ep2": Layout(2, (EP2,)),
    "cp2": Layout(2, (CP2,)),
    "cp2_ep2": Layout(2, (CP2, EP2)),
}


@dataclass(frozen=True)
class Family:
    name: str  # the registry name ([model] name)
    hf_class: str  # transformers' *ForCausalLM class
    hf_config_class: str  # transformers' config class
    base: dict[str, Any]  # the tiny config every case starts from
    cases: dict[str, dict[str, Any]]  # case name -> changes to `base`; each makes features bite
    published: dict[str, Any]  # a published config.json (bf16: no quantization_config)
    aux: Aux
    packed_case: str  # the case of the packed-documents and checkpoint round-trip tests
    expert_width_field: str  # the routed experts' hidden width among the args fields
    flops: Flops
    # refused changes to `published`, by id
    refusals: dict[str, Refusal]
    # args out of their fields' bounds -> `field_problems` messages; args across fields ->
    # `validate()` messages
    bounds: dict[str, ArgsProblems]
    cross_field: dict[str, ArgsProblems]
    # what the published config.json reads as; None: the args' defaults
    published_args: Callable[[], Any] | None = None
    # a config.json holding only `absent_keys[0]` reads as transformers' defaults and as
    # the values `absent_keys[1]` names
    absent_keys: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    # routing-bias buffers (e_score_correction_bias) are drawn with this std (0: none)
    correction_bias_std: float = 0.0
    # after norms and biases are perturbed: what else must be made to matter
    perturb_extra: Callable[[nn.Module, torch.Generator], None] | None = None
    position_offset: int = 0  # where the second test sequence starts (past YaRN's original)
    moe_layers: dict[str, list[int]] = field(default_factory=dict)  # case -> its MoE layers
    # keys of `base`/cases that transformers takes inside rope_parameters, not beside it
    rope_parameter_keys: tuple[str, ...] = ()
    # native args from the transformers-style kwargs where a key is spelled otherwise
    to_native: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # args fields a config.json may hold resolved (ours or transformers' writer wrote the
    # value they stand for) -> that value
    resolved_on_save: dict[str, Callable[[Any], Any]] = field(default_factory=dict)
    # keys the released config.json files add to transformers' own dialect
    published_dialect_extra: dict[str, Any] = field(default_factory=dict)
    # more args whose config.json must read back as themselves, by id
    config_round_trips: dict[str, Any] = field(default_factory=dict)
    # train.py's arguments for the layout check (beside --config=configs/debug_<name>.toml)
    # and the layouts compared with one rank; none: covered elsewhere (`layouts_elsewhere`)
    train_argv: tuple[str, ...] = ()
    layouts: dict[str, Layout] = field(default_factory=dict)
    layouts_elsewhere: str = ""

    @property
    def debug_config(self) -> str:
        return f"configs/debug_{self.name}.toml"


def _hf_rope_name(key: str) -> str:
    return key if key.startswith("rope_") else f"rope_{key}"


def native_kwargs(family: Family, overrides: dict[str, Any]) -> dict[str, Any]:
    """Our args' keyword arguments for `base` with `overrides` (rope keys as `rope_*`)."""
    kwargs = dict(family.base, **overrides)
    kwargs.update({_hf_rope_name(k): v for k, v in kwargs.pop("rope", {}).items()})
    return family.to_native(kwargs) if family.to_native else kwargs

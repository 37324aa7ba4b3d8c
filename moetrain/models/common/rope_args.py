"""RoPE scaling keys of the models that take Hugging Face's `rope_type: yarn` with all of
its options (Qwen3-MoE, DeepSeek-V3): defined once, inherited by their args dataclasses,
read and written as Hugging Face spells them by `moetrain.models.common.hf_rope`.

YaRN keeps every tensor's shape, which is what lets a context-extension stage change it
from a checkpoint trained without it (`checkpoint.init_from`). Torch-free, like every args
module: configs are checked before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.models.common.args import arg as _h

# Why the bounds: YaRN divides the low frequencies by the factor (0 gives inf angles, NaN at
# every step) and is an extension, as transformers requires (factor >= 1: 1 changes
# nothing); the correction range takes log(original length / (beta * 2 pi)), undefined for
# a length or a beta <= 0. Shared with GPT-OSS's args, which declare the same keys.
FACTOR_NOTE = "the context extension: 1 = none; 32 for 4k -> 128k"
LENGTH_NOTE = "the context the checkpoint was pre-trained at, e.g. 4096"
# YaRN's keys act only under rope_type = "yarn": set under "default", they are refused.
YARN = ("rope_type", "yarn")


@dataclass
class YaRNArgs:
    rope_type: str = _h("default", "RoPE scaling: default or yarn", choices=("default", "yarn"))
    rope_factor: float = _h(
        1.0, "YaRN: context extension factor", ge=1, note=FACTOR_NOTE, only_with=YARN
    )
    rope_original_max_position_embeddings: int = _h(
        4096, "YaRN: pre-training context length", gt=0, note=LENGTH_NOTE, only_with=YARN
    )
    rope_beta_fast: float = _h(
        32.0, "YaRN: extrapolation boundary of the ramp", gt=0, only_with=YARN
    )
    rope_beta_slow: float = _h(
        1.0, "YaRN: interpolation boundary of the ramp", gt=0, only_with=YARN
    )
    rope_mscale: float = _h(
        0.0,
        "YaRN: mscale (0 = unset; with mscale_all_dim it sets the cos/sin scale)",
        ge=0,
        note="0 = unset",
        only_with=YARN,
    )
    rope_mscale_all_dim: float = _h(
        0.0,
        "YaRN: mscale_all_dim (0 = unset; also scales the softmax)",
        ge=0,
        note="0 = unset",
        only_with=YARN,
    )
    rope_truncate: bool = _h(True, "YaRN: round the correction range to whole dims", only_with=YARN)

"""RoPE scaling keys of the models that take Hugging Face's `rope_type: yarn` with all of
its options (Qwen3-MoE, DeepSeek-V3): defined once, inherited by their args dataclasses,
read and written as Hugging Face spells them by `models.common.hf_rope`.

YaRN keeps every tensor's shape, which is what lets a context-extension stage change it
from a checkpoint trained without it (`checkpoint.init_from`). Torch-free, like every args
module: configs are checked before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.args import arg as _h


@dataclass
class YaRNArgs:
    rope_type: str = _h("default", "RoPE scaling: default or yarn", choices=("default", "yarn"))
    rope_factor: float = _h(1.0, "YaRN: context extension factor")
    rope_original_max_position_embeddings: int = _h(4096, "YaRN: pre-training context length")
    rope_beta_fast: float = _h(32.0, "YaRN: extrapolation boundary of the ramp")
    rope_beta_slow: float = _h(1.0, "YaRN: interpolation boundary of the ramp")
    rope_mscale: float = _h(
        0.0, "YaRN: mscale (0 = unset; with mscale_all_dim it sets the cos/sin scale)"
    )
    rope_mscale_all_dim: float = _h(
        0.0, "YaRN: mscale_all_dim (0 = unset; also scales the softmax)"
    )
    rope_truncate: bool = _h(True, "YaRN: round the correction range to whole dims")

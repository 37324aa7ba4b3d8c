"""What only GPT-OSS has, beside the model suite (tests/test_models.py and its siblings,
which cover its parity with transformers (windows, sinks, clamps), export, config.json,
the MXFP4 config refusal and layouts from tests/families/gpt_oss.py): MXFP4 expert weights
are refused by name."""

from __future__ import annotations

import pytest

from moetrain.models import HFFormatError
from tests.families.gpt_oss import FAMILY
from tests.families.models import spec_of


def test_mxfp4_expert_blocks_are_refused():
    adapter = spec_of(FAMILY).hf_adapter
    args = FAMILY.published_args()
    with pytest.raises(HFFormatError, match=r"_blocks: the experts are MXFP4"):
        adapter.hf_keys("layers.0.mlp.experts.down_proj", (32, 2880, 2880), args, lambda k: True)

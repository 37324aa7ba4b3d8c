"""Every registered model's table for the model suite (tests/families/family.py).

A new model adds its module here, beside the others; tests/test_models.py fails while a
registered model has no table."""

from tests.families import (
    deepseek_v3,
    ernie4_5_moe,
    glm4_moe,
    gpt_oss,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
)
from tests.families.family import Family

FAMILIES: dict[str, Family] = {
    module.FAMILY.name: module.FAMILY
    for module in (
        deepseek_v3,
        ernie4_5_moe,
        glm4_moe,
        gpt_oss,
        mixtral,
        olmoe,
        qwen2_moe,
        qwen3_moe,
    )
}

"""Where a LoRA run's frozen base came from (`moetrain.checkpoint.frozen_base`): the content
fingerprint of a Hugging Face directory, whole and sampled, the record of checkpoints from
before it existed, and the refusals when the base is gone or changed. (Through train.py:
tests/test_stages.py's LoRA stage, tests/test_lora.py's changed Hugging Face base.)"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import moetrain.checkpoint.frozen_base as frozen_base
from moetrain.checkpoint.frozen_base import check_base, hf_fingerprint, recorded_base
from moetrain.errors import CheckpointError


def _weights(directory, scale: float = 1.0, rows: int = 64) -> None:
    directory.mkdir(exist_ok=True)
    tensors = {"a": torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256) * scale}
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("whole_file_bytes", [256 << 20, 4096], ids=["whole", "sampled"])
def test_the_fingerprint_follows_the_weights_not_the_path(tmp_path, monkeypatch, whole_file_bytes):
    monkeypatch.setattr(frozen_base, "WHOLE_FILE_BYTES", whole_file_bytes)
    monkeypatch.setattr(frozen_base, "SAMPLE_BYTES", 1024)
    _weights(tmp_path / "a")
    _weights(tmp_path / "b")
    first = hf_fingerprint(str(tmp_path / "a"))
    assert first == hf_fingerprint(str(tmp_path / "b"))  # same bytes elsewhere: same base
    _weights(tmp_path / "a", scale=1.5)  # other weights, same names and shapes
    assert hf_fingerprint(str(tmp_path / "a")) != first
    _weights(tmp_path / "a", rows=65)  # another shape: the header differs
    assert hf_fingerprint(str(tmp_path / "a")) != first


def test_a_changed_or_missing_base_is_refused_by_path(tmp_path):
    _weights(tmp_path / "base")
    record = {"source": "hf", "path": str(tmp_path / "base")}
    record["fingerprint"] = hf_fingerprint(record["path"])
    check_base("step-2", record)  # as it was: accepted
    _weights(tmp_path / "base", scale=2.0)
    with pytest.raises(CheckpointError, match="changed since") as err:
        check_base("step-2", record)
    assert "checkpoint.save_frozen=true" in str(err.value)
    gone = {"source": "checkpoint", "path": str(tmp_path / "nothing"), "fingerprint": "x"}
    with pytest.raises(CheckpointError, match="nothing is gone"):
        check_base("step-2", gone)


def test_checkpoints_from_before_the_record_name_their_base_through_their_config():
    def state(model: dict, init_from=None) -> dict:
        config = {"model": model, "train": {"seed": 7}, "checkpoint": {"init_from": init_from}}
        return {"config": config}

    assert recorded_base("c", state({"init_from_hf": "hf"})) == {
        "source": "hf",
        "path": "hf",
        "fingerprint": None,
    }
    assert recorded_base("c", state({})) == {"source": "seed", "seed": 7}
    with pytest.raises(CheckpointError, match="c's checkpoint.init_from=gone"):
        recorded_base("c", state({}, init_from="gone"))

"""The trainer's step on a CUDA device (run on a GPU: `pytest -m gpu tests/test_gpu_step.py`;
`benchmarks/gpu_suite.sh step` runs it on the lent machine).

On CPU, tests/test_guard.py checks the default path's promise with a dispatch mode; here the
same steps run where it matters: fused AdamW's CUDA kernel takes the guard's device verdict
(`found_inf`) and a tensor learning rate, on FSDP's DTensor parameters, and torch's CUDA
sync debug mode reports any synchronizing call made while a step is queued (a blocking copy
to or from the host as well as a value read), by the Python line that made it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moetrain.build.distributed import init_distributed
from moetrain.config import load_config
from moetrain.loop.preflight import preflight
from moetrain.loop.trainer import Trainer
from moetrain.parallelisms.dims import ParallelDims
from tests.parity import TINY, _full
from tests.test_guard import _guard_worker, check_skip_changed_nothing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)"),
]
CUDA = ["--train.device=cuda"]


@pytest.fixture
def world_of_one():
    init_distributed(torch.device("cuda", 0))  # nccl, a world of one (plain python train.py)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_cuda_step_syncs_nothing_and_its_skip_changes_nothing(precision, tmp_path, world_of_one):
    argv = [*TINY, *CUDA, f"--train.mixed_precision={precision}"]
    _guard_worker(0, 1, argv, str(tmp_path / "out.pt"))
    # Scatter-adds by atomics make CUDA's backward differ from run to run by rounding. In
    # fp32 the experts' GEMMs take the loop fallback (torch's grouped GEMM is bf16 only on
    # CUDA), which reads the tokens per expert: an allowed read.
    fallback = "moetrain/models/common/moe.py" if precision == "fp32" else None
    out = torch.load(tmp_path / "out.pt")
    check_skip_changed_nothing(out, False, loss_rtol=1e-4, allowed_reads=fallback)


def test_fused_adamw_on_cuda_agrees_with_foreach(world_of_one):
    finals = {}
    for impl in ("fused", "foreach"):
        cfg = load_config([*TINY, *CUDA, f"--train.optimizer_impl={impl}"])
        dims = ParallelDims.of(cfg.parallel, 1)
        trainer = Trainer(cfg, dims, preflight(cfg, dims))
        assert bool(trainer.optimizer.defaults.get("fused")) == (impl == "fused")
        losses = [trainer.steps.train_step(trainer.next_micro_batches())["loss"] for _ in range(3)]
        params = {n: _full(p) for n, p in trainer.model.named_parameters()}
        finals[impl] = losses, params
    (fused_losses, fused), (foreach_losses, foreach) = finals["fused"], finals["foreach"]
    assert fused_losses == pytest.approx(foreach_losses, rel=1e-4)
    for name, p in fused.items():
        torch.testing.assert_close(p, foreach[name], rtol=1e-4, atol=1e-5, msg=name)

"""The suite's two tiers: `make test-fast` runs the tests not marked `slow`, in this one
process; every test that launches ranks (tests/distributed.py: forked ranks, torchrun) must
be marked `slow`, so that the fast tier stays fast as the suite grows. A fast test that
launches is failed here, naming the mark to add."""

from __future__ import annotations

import subprocess

import pytest

import tests.distributed as distributed


class _NoTorchrun(subprocess.Popen):
    def __init__(self, args, *rest, **kwargs):
        if "torch.distributed.run" in (args if isinstance(args, list | tuple) else [args]):
            raise AssertionError(_REFUSAL.format(what="torchrun"))
        super().__init__(args, *rest, **kwargs)


_REFUSAL = (
    "a test not marked slow launched {what}: mark it @pytest.mark.slow (multi-process runs "
    "belong to `make test`, not `make test-fast`)"
)


@pytest.fixture(autouse=True)
def _fast_tier_launches_nothing(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        return

    def refuse(*_args, **_kwargs):
        raise AssertionError(_REFUSAL.format(what="ranks"))

    monkeypatch.setattr(distributed, "_fork", refuse)
    monkeypatch.setattr(subprocess, "Popen", _NoTorchrun)

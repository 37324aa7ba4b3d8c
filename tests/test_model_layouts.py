"""The model suite's layouts: every family's debug config trained for 3 steps on each of the
parallel layouts its table lists (FSDP, EP, CP, CP x EP, pipeline stages) agrees with the
same config on one rank, losses and grad norms within 1e-5 relative (docs/models.md, "When
layouts agree within 1e-5").

The runs share launches: ONE launch of 1 rank, ONE of 2 and ONE of 4 (the layouts that
need 4) run every family's runs of that world in turn, in-process on forked ranks
(tests/distributed.py), each Trainer built as train.py builds it (tests/parity.py's
`build_trainer`); then one test per (family, layout) reads its result. The front door
itself (train.py through torchrun, metrics.jsonl) is tested in tests/test_train_cli.py.
Layouts against an independent one-process reference: tests/test_layout_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import ROOT, run_distributed
from tests.families import FAMILIES
from tests.families.family import Family
from tests.families.layouts import ONE_RANK, layout_argv, layout_runs_worker, run_key

LAYOUTS = [
    pytest.param(family, layout, id=f"{name}-{layout}")
    for name, family in FAMILIES.items()
    for layout in family.layouts
]


def _runs_by_world(out_root: Path) -> dict[int, list[tuple[str, list[str]]]]:
    by_world: dict[int, list[tuple[str, list[str]]]] = {}
    for family in FAMILIES.values():
        if not family.layouts:
            continue
        worlds = {ONE_RANK: 1} | {name: layout.world for name, layout in family.layouts.items()}
        for layout, world in worlds.items():
            key = run_key(family, layout)
            argv = layout_argv(family, layout, str(out_root / key))
            by_world.setdefault(world, []).append((key, argv))
    return by_world


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory) -> dict[str, list | str]:
    """Every family's runs, one launch per world size: {run key: records or error}."""
    out_root = tmp_path_factory.mktemp("layouts")
    results: dict[str, list | str] = {}
    with pytest.MonkeyPatch.context() as env:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.delenv(var, raising=False)
        env.chdir(ROOT)  # the debug configs' paths
        for world, runs in sorted(_runs_by_world(out_root).items()):
            out = out_root / f"world{world}.pt"
            run_distributed(layout_runs_worker, world, runs, str(out))
            results |= torch.load(out)
    return results


def _records(results: dict[str, list | str], family: Family, layout: str) -> list:
    found = results[run_key(family, layout)]
    if isinstance(found, str):
        pytest.fail(f"{run_key(family, layout)} failed:\n{found}")
    return found


def test_every_family_has_its_layouts_checked():
    """Here, or (for those checked against an independent reference) in a file it names."""
    for family in FAMILIES.values():
        assert bool(family.layouts) != bool(family.layouts_elsewhere), family.name
        for path in family.layouts_elsewhere.split():
            if path.startswith("tests/"):
                assert (ROOT / path).is_file(), (family.name, path)


@pytest.mark.slow
@pytest.mark.parametrize("family, layout", LAYOUTS)
def test_losses_and_grad_norms_agree_with_one_rank(layout_runs, family: Family, layout: str):
    one = _records(layout_runs, family, ONE_RANK)
    run = _records(layout_runs, family, layout)
    print(f"\n{family.name} 1 rank: {one}\n{layout}: {run}")
    assert [step for step, _, _ in one] == [step for step, _, _ in run] == [1, 2, 3]
    for what, column in (("loss", 1), ("grad_norm", 2)):
        want = [record[column] for record in one]
        assert [record[column] for record in run] == pytest.approx(want, rel=1e-5), what

"""The shipped hg38 run configs carry the layout the planner ranks first for their own case (64 B200 within
the published recipe's 144.5 GiB per GPU): `benchmarks/plan_table.py`'s cases, searched as a reader runs
`genomelm plan configs/train/hg38-<seq>.yaml search=true`; and the config's own plan fits the budget it
names."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from genomelm.plan.check import make_plan
from genomelm.plan.memory import TraceCache
from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def _plan_table():
    if "plan_table" not in sys.modules:
        spec = importlib.util.spec_from_file_location("plan_table", ROOT / "benchmarks" / "plan_table.py")
        module = sys.modules["plan_table"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["plan_table"]


SHIPPED = [case for case in _plan_table().CASES if case.shipped]


@pytest.mark.slow
@pytest.mark.parametrize("case", SHIPPED, ids=[case.config for case in SHIPPED])
def test_shipped_config_is_the_plans_first_choice_and_fits_its_budget(case) -> None:
    table = _plan_table()
    traces = TraceCache()
    best = table.first_choice(case, traces)
    assert table.layout_of(best) == table.shipped_layout(case), (
        f"configs/train/{case.config}.yaml drifted from the plan's first choice: "
        "run `python benchmarks/plan_table.py --check` and copy the first layout into the config"
    )
    shipped = TrainConfig.load(ROOT / "configs" / "train" / f"{case.config}.yaml", ["device=cpu"])
    plan = shipped.plan  # the config names the GPUs and the budget its layout was chosen for
    assert (plan.gpus, plan.gpu, plan.gpu_gib) == (64, case.gpu, case.gpu_gib)
    own = make_plan(shipped, traces=traces)
    assert own.fits and own.peak_gib_per_rank <= case.gpu_gib

"""The red team's faults that only a real command line shows (`benchmarks/red_team.py` prints them all as a
table): each ends with the documented exit status and one line, leaves the run folder as it should and no
process behind. The faults a test can inject in one process are tested beside their code (test_run_folder,
test_checkpoint_integrity, test_train_config, test_parallel_launch, test_data_integrity,
test_eval_variants). The rows launcher-killed-cp2, blocked-checkpoint-cp2, resumed-as-one-process and
eval-during-training (13-25 s each here) are left to the benchmark: what each relies on has a faster test
beside its code (test_parallel_launch, test_run_folder, test_train_config, test_checkpoint_integrity)."""

from __future__ import annotations

import contextlib

import pytest
from benchmark_modules import benchmark
from local_ray import one_local_ray

red_team = benchmark("red_team")

IN_THE_SUITE = [
    "damaged-only-checkpoint-cp2",
    "start-up-local",
    "start-up-ray",
    "damaged-data-cp2",
    "rank-killed-cp2",
    "rank-stuck-cp2",
    "read-only-run-folder",
    "eval-launcher-killed-cp2",
    "eval-sigterm-one-process",
    "torchrun-sigkill-rank1",
    "torchrun-sigusr1-rank1",
    "disk-full-init",
    "disk-full-checkpoint-cp2",
    "disk-full-metrics",
    "setting-cp=3",
    "setting-seq",
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> object:
    return red_team.Lab(tmp_path_factory.mktemp("red-team"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", IN_THE_SUITE)
def test_the_fault_ends_clean(lab: object, fault: str) -> None:
    with one_local_ray() if fault.endswith("-ray") else contextlib.nullcontext():
        row = red_team.faults()[fault](lab)
    if row.skipped:
        pytest.skip(row.skipped)
    assert row.clean, red_team.format_table([row])

"""Experts placed by load (`genomelm.parallel.placement`): the static blocks, the greedy packing with replicas
held to hand-worked cases and to lower bounds, and the Zipf load fitted to the published 4x at ep=32."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from benchmark_modules import benchmark

from genomelm.parallel.placement import (
    Placement,
    balanced_placement,
    fit_zipf,
    placement_with_replicas,
    replica_counts,
    static_placement,
    zipf_load,
)


def test_static_blocks_are_todays_layout() -> None:
    placement = static_placement(8, 4)
    assert placement.slots == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert placement.busiest_over_mean([1.0] * 8) == 1.0
    assert placement.rank_loads([4, 3, 2, 1, 0, 0, 0, 6]) == [7, 3, 0, 6]
    with pytest.raises(ValueError, match="ep=3 does not divide the 8"):
        static_placement(8, 3)


def test_packing_a_hand_worked_case() -> None:
    load = [4.0, 3.0, 2.0, 1.0]  # static blocks: [7, 3], busiest/mean 1.4
    assert static_placement(4, 2).busiest_over_mean(load) == pytest.approx(1.4)
    balanced = balanced_placement(load, 2)  # 4 -> r0, 3 -> r1, 2 -> r1, 1 -> r0
    assert balanced.slots == ((0, 3), (1, 2))
    assert balanced.busiest_over_mean(load) == 1.0
    # heaviest-first alone ends at [3 2 2 | 3 2 0] = [7, 5]; the swap of a 3 for a 2 evens it
    load = [3.0, 3.0, 2.0, 2.0, 2.0, 0.0]
    assert balanced_placement(load, 2).rank_loads(load) == [6.0, 6.0]


def test_a_hot_expert_is_replicated_onto_other_ranks() -> None:
    load = [9.0, 1.0, 1.0, 1.0]
    assert replica_counts(load, 6, most=2) == [2, 2, 1, 1]  # expert 0 at its cap of one copy per rank
    placement = balanced_placement(load, 2, spare=1)
    assert [len(rank) for rank in placement.slots] == [3, 3]
    assert all(len(set(rank)) == len(rank) for rank in placement.slots)  # no rank holds an expert twice
    assert placement.copies(4) == [2, 2, 1, 1]
    assert placement.rank_loads(load) == [6.0, 6.0]
    assert balanced_placement(load, 2).busiest_over_mean(load) == pytest.approx(10 / 6)  # no spare: 9 + 1
    with pytest.raises(ValueError, match="spare"):
        balanced_placement(load, 1, spare=1)


@pytest.mark.parametrize("seed", range(40))
def test_packing_keeps_every_token_and_never_loses_to_the_static_blocks(seed: int) -> None:
    """Any shape without spare slots; with them at the model's 288 experts. (On a few experts a spare slot
    can force an unhelpful replica: 4 experts on 2 ranks of 3 slots must copy two of them.)"""
    rng = random.Random(seed)
    ep = rng.choice([2, 4, 8, 16, 32])
    experts = 288 if seed % 2 else ep * rng.choice([2, 3, 9])
    load = [rng.expovariate(1.0) ** rng.choice([1, 2, 3]) for _ in range(experts)]
    static = static_placement(experts, ep).busiest_over_mean(load)
    for spare in (0, 1, 2) if experts == 288 else (0,):
        placement = balanced_placement(load, ep, spare)
        assert [len(rank) for rank in placement.slots] == [experts // ep + spare] * ep
        assert all(len(set(rank)) == len(rank) for rank in placement.slots)
        assert min(placement.copies(experts)) >= 1
        assert sum(placement.rank_loads(load)) == pytest.approx(sum(load))
        assert placement.busiest_over_mean(load) <= static + 1e-12


def test_the_fitted_zipf_load_and_what_placement_makes_of_it() -> None:
    exponent = fit_zipf(288, 32, 4.0)
    load = zipf_load(288, exponent)
    assert sum(load) == pytest.approx(288)
    assert static_placement(288, 32).busiest_over_mean(load) == pytest.approx(4)
    # without spare slots the rank holding the hottest expert also fills its 8 other slots: the bound is met
    coldest = sorted(load)
    bound = (coldest[-1] + sum(coldest[:8])) / 9
    assert balanced_placement(load, 32).busiest_over_mean(load) == pytest.approx(bound)
    assert balanced_placement(load, 32, spare=1).busiest_over_mean(load) < 1.01
    with pytest.raises(ValueError, match="busiest_over_mean=40"):
        fit_zipf(288, 32, 40)


def test_a_placement_without_some_expert_is_refused() -> None:
    with pytest.raises(ValueError, match="expert 3 has no slot"):
        Placement(((0, 1), (2, 2))).rank_loads([1.0, 1.0, 1.0, 1.0])


def test_the_balance_benchmarks_placement_table() -> None:
    bench = benchmark("moe_balance")
    rows = bench.placement_rows(4.0, seed=0)
    assert [row["ep"] for row in rows] == [8, 16, 32]
    assert rows[-1]["static"] == pytest.approx(4.0)
    assert all(1 <= row["joint"] <= row["copies"] <= row["placed"] <= row["static"] for row in rows)
    table = bench.format_table(rows, with_plan=False).splitlines()
    assert len(table) == 5 and table[-1].startswith("| 4.0x |") and table[-1].count("|") == 8


def test_the_balance_benchmark_reads_a_runs_logged_load(tmp_path: Path) -> None:
    bench = benchmark("moe_balance")
    logged = tmp_path / "expert_load.json"  # as `RoutedTotals.write` leaves it: two layers of 8 experts
    logged.write_text(
        json.dumps({"through_step": 4, "steps": 4, "counts": {"1": [8, 0, 0, 0, 4, 4, 0, 0], "3": [1] * 8}})
    )
    rows = bench.logged_rows(logged)
    assert [row["ep"] for row in rows] == [2, 4, 8]
    # ep=2, layer 1: static [8, 8] and layer 3: [4, 4]: even already
    assert rows[0]["static"] == rows[0]["placed"] == 1.0
    # ep=4: layer 1 static [8, 0, 8, 0] (busiest 8, mean 4), placed [8, 4, 4, 0]; layer 3 [2, 2, 2, 2]
    assert rows[1]["static"] == pytest.approx((8 + 2) / (4 + 2))
    assert rows[1]["placed"] == pytest.approx((8 + 2) / (4 + 2))  # the 8 alone sets it
    # ep=8: one expert a rank, nothing to move
    assert rows[2]["static"] == rows[2]["placed"] == pytest.approx((8 + 1) / (2 + 1))


def test_a_placement_training_runs_owns_each_expert_once_and_orders_copies_by_owner() -> None:
    """`slots_of`: each expert's slots over the ranks (rank x slots per rank + its place there), the owner's
    first; the first experts / ep slots of a rank own their experts, the rest are copies."""
    assert Placement(((3, 0), (1, 2))).slots_of(4, 2) == [[1], [2], [3], [0]]
    assert static_placement(8, 4).slots_of(8, 4) == [[e] for e in range(8)]
    # 3 slots per rank: expert 0 owned by rank 1 (slot 3) with a copy on rank 0 (slot 2)
    assert Placement(((3, 1, 0), (0, 2, 1))).slots_of(4, 2) == [[3, 2], [1, 5], [4], [0]]
    with pytest.raises(ValueError, match="needs 2\\+ per rank"):
        Placement(((0, 1, 2), (3,))).slots_of(4, 2)
    with pytest.raises(ValueError, match="expert 1 is owned twice"):
        Placement(((0, 1), (1, 2))).slots_of(4, 2)
    with pytest.raises(ValueError, match="expert 4 is owned twice or is not one of the 4"):
        Placement(((0, 1), (2, 4))).slots_of(4, 2)
    with pytest.raises(ValueError, match="rank 0 holds an expert twice"):
        Placement(((0, 1, 0), (2, 3, 1))).slots_of(4, 2)
    with pytest.raises(ValueError, match="not ordered by their owner's rank"):
        Placement(((0, 1, 4, 2), (2, 3, 0, 1), (4, 5, 0, 2))).slots_of(6, 3)


def test_copies_take_the_hottest_experts_and_never_lose_to_the_owners_alone() -> None:
    """`placement_with_replicas`, what training runs with spare slots: at the published 4x (a Zipf load,
    static blocks 4x at ep=32) one spare slot per rank brings ep=16 and ep=32 near the mean, where owners
    alone leave 1.6x and 2.9x; the copies are valid for training and go to the hot experts."""
    load = zipf_load(288, fit_zipf(288, 32, 4.0))
    for ep, alone in ((16, 1.62), (32, 2.93)):
        placed = placement_with_replicas(load, ep, 1)
        placed.slots_of(288, ep)  # runnable: raises otherwise
        assert balanced_placement(load, ep).busiest_over_mean(load) == pytest.approx(alone, abs=0.01)
        assert placed.busiest_over_mean(load) < 1.1
        copied = [e for e, n in enumerate(placed.copies(288)) if n > 1]
        assert min(load[e] for e in copied) > sorted(load)[-len(copied) - 1]  # the hottest experts
    uniform = [1.0] * 16
    assert placement_with_replicas(uniform, 4, 1) == balanced_placement(uniform, 4)  # nothing to gain


def test_a_ranks_expert_rows_are_described_as_runs_of_consecutive_experts() -> None:
    """What DCP is told of a rank's rows (`genomelm.parallel.expert_rows`): a chunk of the [E, ...] tensor per
    run of consecutive experts, each a view of the local rows."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from genomelm.parallel.expert_rows import ExpertRows, expert_runs

    assert expert_runs([3, 4, 5, 0, 1, 7]) == [(0, 3, 3), (3, 0, 2), (5, 7, 1)]
    assert expert_runs(range(4, 8)) == [(0, 4, 4)]  # the static block: one chunk, as a DTensor's
    local = torch.arange(4 * 3.0).view(4, 3)
    rows = ExpertRows(local, [6, 7, 0, 2], 8)
    assert rows.shape == (8, 3)
    chunks = rows.__create_chunk_list__()
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in chunks] == [
        ((6, 0), (2, 3)),
        ((0, 0), (1, 3)),
        ((2, 0), (1, 3)),
    ]
    items = rows.__create_write_items__("w", rows)
    assert [tuple(i.index.offset) for i in items] == [(6, 0), (0, 0), (2, 0)]
    assert all(i.tensor_data.size == (8, 3) for i in items)
    shard = rows.__get_tensor_shard__(MetadataIndex("w", torch.Size((2, 0))))
    shard.fill_(-1.0)  # a view: DCP's reads land in the local rows
    assert local[3].tolist() == [-1.0] * 3
    with pytest.raises(ValueError, match="no expert rows at"):
        rows.__get_tensor_shard__(MetadataIndex("w", torch.Size((1, 0))))
    with pytest.raises(RuntimeError, match="describes a checkpoint's expert rows"):
        rows + 1


def test_a_resumed_run_places_its_experts_by_the_load_it_routed(tmp_path: Path, capsys) -> None:
    """`expert_placement=balanced`: at a resume, each MoE layer placed by the checkpoint's routed totals,
    written to the run folder and said in one line; a fresh run, or `static`, keeps the static blocks."""
    from genomelm.model import ModelConfig
    from genomelm.run.config import TrainConfig
    from genomelm.train.loop import placed_by_load

    config = TrainConfig.from_args(["model=tiny", "dp=2", "ep=2", f"runs_dir={tmp_path}", "run=r"])
    config = config.replace(expert_placement="balanced")
    tiny = ModelConfig.preset("tiny")
    routed = {"steps": 3, "counts": {"1": [4, 3, 2, 1, 0, 0, 0, 0], "2": [1] * 8}}
    (tmp_path / "r").mkdir()
    placed = placed_by_load(config, tiny, {"step": 3, "routed": routed}, None)
    assert placed[1].placement.slots == ((0, 3, 6, 7), (1, 2, 4, 5)) and placed[1].static == 2.0
    assert placed[1].placed == 1.0 and placed[2].placed == placed[2].static == 1.0
    written = json.loads((tmp_path / "r" / "expert_placement.json").read_text())
    assert written["load_through_step"] == 3 and written["layers"]["1"]["slots"] == [
        [0, 3, 6, 7],
        [1, 2, 4, 5],
    ]
    said = capsys.readouterr().out
    assert (
        "experts placed by the routed load of steps 1-3: the busiest rank's rows over the mean 1.50 -> 1.00"
        in said
    )
    assert placed_by_load(config, tiny, None, None) == {}  # a fresh run: no load yet
    assert (
        placed_by_load(config.replace(expert_placement="static"), tiny, {"step": 3, "routed": routed}, None)
        == {}
    )


def test_exact_moments_come_back_for_every_parameter_whose_experts_stayed() -> None:
    """A resume under a new placement keeps the quantised moments as saved for every parameter but the
    expert parameters whose experts moved (those take the state dict's requantised ones); another mesh
    keeps none."""
    from genomelm.parallel.checkpoint import exact_moments, load_exact_moments

    class Quantised:
        def __init__(self) -> None:
            self.loaded: dict = {}

        def exact_state(self) -> dict:
            return {0: "embedding's", 1: "layer 1 experts'", 2: "layer 2 experts'"}

        def load_exact_state(self, exact: dict) -> None:
            self.loaded = exact

    world = {"dp": 2, "cp": 1, "ep": 2}
    saved = exact_moments(Quantised(), world, {1: [3, 0], 2: [1, 2]})
    optimizer = Quantised()
    load_exact_moments(optimizer, saved, world, {1: [3, 0], 2: [2, 1]})  # layer 2's experts moved
    assert optimizer.loaded == {0: "embedding's", 1: "layer 1 experts'"}
    load_exact_moments(optimizer, saved, world | {"dp": 4}, {1: [3, 0], 2: [1, 2]})
    assert optimizer.loaded == {0: "embedding's", 1: "layer 1 experts'"}  # another mesh: nothing loaded
    static = exact_moments(Quantised(), world)
    load_exact_moments(optimizer, static, world)
    assert optimizer.loaded == Quantised().exact_state()


def test_a_torn_expert_load_file_is_named(tmp_path: Path) -> None:
    from genomelm.run.metrics import read_expert_load

    logged = tmp_path / "expert_load.json"
    logged.write_text('{"through_step": 4, "counts": {"1": [8, 0')
    with pytest.raises(ValueError, match=rf"^{re.escape(str(logged))} is not a routed-load file .*remove it"):
        read_expert_load(logged)

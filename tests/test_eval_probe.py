"""The copy probe: what is planted where and scored, a model of known reach, and the command end to end."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from data_fixtures import DMEL, DMEL_RECORD, read_records
from scipy import stats

from genomelm.cli import main as cli_main
from genomelm.data import BUILTIN
from genomelm.data.windows import Window
from genomelm.eval.evaluate import HeldoutSet
from genomelm.eval.probe import (
    ProbeError,
    ProbeScores,
    ProbeSite,
    format_probe_table,
    gap_estimates,
    parse_distances,
    plant,
    probe_sites,
    run_probe,
    score_probe,
    write_probe_outputs,
)
from genomelm.run.config import TrainConfig

FLY = read_records(DMEL)[DMEL_RECORD]
CODE = {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5}


def window(letters: str) -> Window:
    """A held-out window of the built-in ids, from sequence text."""
    ids = torch.tensor([CODE[c] for c in letters.upper()])
    return Window("fly", 0, DMEL_RECORD, 0, len(ids), ids, torch.zeros(len(ids), dtype=torch.bool), BUILTIN)


class Recorder(torch.nn.Module):
    """Remembers every (input_ids, labels) it scores; its loss at position t is t (0 where the label is
    -100)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        self.calls.append((input_ids[0].clone(), labels[0].clone()))
        loss = torch.arange(input_ids.shape[1], dtype=torch.float32)[None]
        return torch.where(labels == -100, 0.0, loss)


def test_probe_construction_by_hand() -> None:
    letters = FLY[500_000:500_040].upper()
    assert "N" not in letters
    letters = (
        letters[:37] + "N" + letters[38:]
    )  # the target's 3rd base (token 37) is N: its position is not scored
    w = window(letters)
    sites, skipped = probe_sites(40, 5, [3, 10, 30, 36])
    assert sites == [ProbeSite(35, 10, 5), ProbeSite(35, 30, 5)]  # target: the last 5 bases, [35, 40)
    assert [s["distance"] for s in skipped] == [3, 36]
    assert "overlap" in skipped[0]["reason"] and "at most 35 apart" in skipped[1]["reason"]
    assert sites[0].source == 25 and sites[0].scored == slice(
        35, 39
    )  # positions 35..38 predict tokens 36..39

    planted = plant(w, sites[0])
    ids, labels = planted.input_ids, planted.labels
    original = w.input_ids
    assert torch.equal(ids[25:30], original[35:40])  # the copy, 10 tokens before the target
    keep = torch.ones(40, dtype=torch.bool)
    keep[25:30] = False
    assert torch.equal(ids[keep], original[keep])  # nothing else changed
    copied = original[35:40].tolist()
    copied[2] = -100  # the copied N (token 27) is no label
    assert labels[24:29].tolist() == copied and labels[29] == original[30]
    assert torch.equal(labels[35:39], w.labels[35:39])  # the scored labels are the window's own

    model = Recorder()
    scores = score_probe(model, [w], length=5, distances=[10, 30])
    (base_ids, base_labels), (ids10, _), (ids30, _) = model.calls
    assert torch.equal(base_ids, original) and torch.equal(base_labels, w.labels)  # the baseline is untouched
    assert torch.equal(ids10, ids) and torch.equal(ids30[5:10], original[35:40])
    assert not torch.equal(original[5:10], original[35:40]) and not torch.equal(
        original[25:30], original[35:40]
    )
    # scored: positions 35, 37, 38 (36 predicts the N): loss t summed, in both windows
    assert scores.tokens.tolist() == [[3, 3]]
    assert scores.planted.tolist() == [[110.0, 110.0]] and scores.baseline.tolist() == [[110.0, 110.0]]
    assert torch.equal(w.input_ids, original)  # the window itself is never modified


class ReachModel(torch.nn.Module):
    """Sees back exactly ``reach`` tokens: predicts base t+1 perfectly (loss 0) when the ``k`` bases ending at
    t occurred before and the base that followed them is at most ``reach`` tokens back; else loss log 4."""

    def __init__(self, reach: int, k: int = 12) -> None:
        super().__init__()
        self.reach, self.k = reach, k
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        ids, targets = input_ids[0].tolist(), labels[0].tolist()
        loss = torch.full((len(ids),), math.log(4))
        follower: dict[tuple[int, ...], int] = {}  # k-mer -> position of the base after its latest occurrence
        for t in range(len(ids)):
            if t >= self.k:
                follower[tuple(ids[t - self.k : t])] = t
            seen = follower.get(tuple(ids[t - self.k + 1 : t + 1])) if t + 1 >= self.k else None
            if seen is not None and t + 1 - seen <= self.reach and targets[t] == ids[seen]:
                loss[t] = 0.0
        return torch.where(labels == -100, 0.0, loss[None])


def test_model_with_known_reach_shows_gap_up_to_it_and_none_beyond(tmp_path: Path, capsys) -> None:
    seq = 10_240
    windows = [window(FLY[start : start + seq]) for start in (100_000, 400_000, 700_000)]
    config = TrainConfig().replace(run="reach", probe_length=200, probe_distances="1k,2k,4k,6k,8k,16k")
    models = {"short": ReachModel(1024), "long": ReachModel(4096)}
    provenance = {"data_dir": "fly", "windows": [{"index": i} for i in range(3)]}
    result = run_probe(config, HeldoutSet("fly", windows, provenance), models.__getitem__, "short", "long")
    settings = result["settings"]
    assert settings["distances"] == [1024, 2048, 4096, 6144, 8192]
    assert [s["distance"] for s in settings["skipped"]] == [16384] and settings["targets"] == [seq - 200] * 3
    for row in result["distances"]:
        assert row["windows"] == 3 and row["tokens"] == 3 * 199
        for name, reach in (("before", 1024), ("after", 4096)):
            gap = row[name]["gap"]
            if row["distance"] <= reach:  # 188 of the 199 scored bases have their 12-mer inside the copy
                assert gap > 0.8 * math.log(4) * 188 / 199 and row[name]["planted"] < 0.1, (name, row)
            else:
                assert gap == 0.0 and row[name]["planted"] == row[name]["baseline"], (name, row)
    paths = write_probe_outputs(result, tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert saved["distances"][2]["after"]["gap"] == pytest.approx(result["distances"][2]["after"]["gap"])
    with open(paths["csv"], newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["distance"]) for r in rows] == settings["distances"]
    assert float(rows[3]["after_gap"]) == 0 and float(rows[2]["after_gap"]) > 1
    assert paths["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp"))
    assert float(rows[2]["gap_change"]) > 1 and float(rows[0]["gap_change"]) == 0  # 4k: after reaches it
    table = format_probe_table(result)
    assert "skipped 16,384: does not fit" in table and table.splitlines()[4].split()[0] == "4,096"
    # each gap and the change carry an interval; the after model's gap at 4k and its change exclude 0
    assert table.splitlines()[4].count("±") == 3 and table.splitlines()[4].rstrip().endswith("*")


def test_gap_intervals_are_t_intervals_across_windows_and_the_change_is_paired() -> None:
    """With equal scored bases per window the gap is the mean of the windows' gaps, its interval Student's t
    over them, and the change's interval the t interval of the windows' differences: narrower than either
    model's when what a window adds to both models' gaps cancels."""
    rng = np.random.default_rng(3)
    tokens = np.full((6, 1), 100)
    shared = rng.normal(0.0, 0.5, (6, 1))  # what a window does to both models' gaps
    before_gap, after_gap = 0.1 + shared, 0.3 + shared + rng.normal(0.0, 0.02, (6, 1))
    baseline = np.full((6, 1), 130.0)
    scores = {
        "before": ProbeScores(baseline - 100 * before_gap, baseline, tokens),
        "after": ProbeScores(baseline - 100 * after_gap, baseline, tokens),
    }
    gaps = gap_estimates(scores, 0)
    for name, per_window in (
        ("before", before_gap),
        ("after", after_gap),
        ("change", after_gap - before_gap),
    ):
        expected = stats.t.interval(0.95, 5, loc=per_window.mean(), scale=stats.sem(per_window[:, 0]))
        assert (gaps[name].low, gaps[name].high) == pytest.approx(expected, abs=1e-9), name
    assert gaps["change"].value == pytest.approx(0.2, abs=0.02) and gaps["change"].excludes_zero
    assert not gaps["before"].excludes_zero and gaps["change"].half_width < gaps["after"].half_width / 10


def test_parse_distances_and_nothing_fits() -> None:
    assert parse_distances("1k,4k,16k,64k,256k,1M") == [1024, 4096, 16384, 65536, 262144, 1 << 20]
    assert parse_distances(" 4k, 1k,4096") == [1024, 4096]
    with pytest.raises(ProbeError, match="'2x' is not a distance"):
        parse_distances("1k,2x")
    config = TrainConfig().replace(probe_length=200, probe_distances="64k,1M")
    with pytest.raises(ProbeError, match="no distance of probe_distances=64k,1M fits windows of 1,000 bases"):
        heldout = HeldoutSet("fly", [window(FLY[:1000])], {})
        run_probe(config, heldout, lambda path: pytest.fail("loaded a model"), "a", "b")


def test_probe_command_end_to_end(demo_outputs, tmp_path: Path, capsys) -> None:
    eval_result = json.loads(demo_outputs[0].read_text())
    provenance = eval_result["provenance"]
    run = [
        "run=demo",
        "seq=128",
        "model=tiny",
        f"data={provenance['data_dir']}",
        f"results_dir={tmp_path}",
        "probe_length=16",
        "probe_distances=16,32,64,128",
        "probe_windows=2",
        "--before",
        provenance["before_model"],
        "--after",
        provenance["after_model"],
    ]
    assert cli_main(["probe", *run]) == 0
    out = capsys.readouterr().out
    assert "distance 128 skipped: does not fit" in out and "copy_probe.json" in out
    result = json.loads((tmp_path / "demo" / "copy_probe.json").read_text())
    assert result["settings"]["distances"] == [16, 32, 64] and result["settings"]["windows"] == 2
    assert result["provenance"]["after_model"].endswith("checkpoints/step-0000004/model")
    for row in result["distances"]:
        assert row["tokens"] == 2 * 15
        for name in ("before", "after"):
            assert np.isfinite([row[name]["planted"], row[name]["baseline"], row[name]["gap"]]).all()
            assert row[name]["gap"] == pytest.approx(row[name]["baseline"] - row[name]["planted"])
    assert (tmp_path / "demo" / "copy_probe.png").read_bytes()[:4] == b"\x89PNG"
    assert len((tmp_path / "demo" / "copy_probe.csv").read_text().splitlines()) == 4
    assert cli_main(["probe", *run, "probe_distances=1k,abc"]) == 2
    assert "'abc' is not a distance" in capsys.readouterr().err


@pytest.mark.slow
def test_probe_cp2_equals_cp1(demo_outputs, tmp_path: Path, capsys) -> None:
    """`cp=2`: each window split over two local processes, through the launch `genomelm eval cp=2` uses."""
    provenance = json.loads(demo_outputs[0].read_text())["provenance"]
    results = {}
    for cp in (1, 2):
        run = [
            "run=demo",
            "seq=128",
            "model=tiny",
            f"data={provenance['data_dir']}",
            f"results_dir={tmp_path / str(cp)}",
            "probe_length=16",
            "probe_distances=16,64",
            "probe_windows=2",
            f"cp={cp}",
            "cp_layout=contiguous",
            "--before",
            provenance["before_model"],
            "--after",
            provenance["after_model"],
        ]
        assert cli_main(["probe", *run]) == 0
        results[cp] = json.loads((tmp_path / str(cp) / "demo" / "copy_probe.json").read_text())
    capsys.readouterr()
    one, two = results[1], results[2]
    assert two["settings"] == one["settings"] and two["settings"]["distances"] == [16, 64]
    for row_one, row_two in zip(one["distances"], two["distances"], strict=True):
        assert (row_two["windows"], row_two["tokens"]) == (row_one["windows"], row_one["tokens"]) == (2, 30)
        for name in ("before", "after"):
            # the interval's ends are the gap -+ t(1 d.f.) = 12.7 standard errors: 12.7 x the se's tolerance
            tolerance = {key: 1.3e-5 if key in ("gap_low", "gap_high") else 1e-6 for key in row_one[name]}
            for key, value in row_one[name].items():
                assert row_two[name][key] == pytest.approx(value, rel=1e-5, abs=tolerance[key]), key
        change_one, change_two = row_one["gap_change"]["value"], row_two["gap_change"]["value"]
        assert change_two == pytest.approx(change_one, rel=1e-5, abs=1e-6)

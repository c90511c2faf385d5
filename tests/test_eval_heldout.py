"""`genomelm eval` on several held-out sets: results side by side, each as the one-set evaluation gives it."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from data_fixtures import HG38_FRAGMENTS, HG38_RECORDS
from test_eval_buckets import VOCAB, EmaUnigram, make_windows

from genomelm.commands.data import main as data_main
from genomelm.commands.eval import main
from genomelm.eval.evaluate import (
    EvalError,
    HeldoutSet,
    evaluate_sets,
    heldout_folders,
    load_heldout,
    write_outputs,
)
from genomelm.eval.report import jsonable, result_sets
from genomelm.eval.table import format_table
from genomelm.eval.window_table import recompute
from genomelm.run.config import TrainConfig


def synthetic_sets() -> list[HeldoutSet]:
    sets = []
    for name, seed, count in (("fly", 0, 4), ("human", 1, 3)):
        windows = make_windows(count, 12, seed=seed)
        provenance = {"data_dir": f"prepared/{name}", "windows": [{"index": i} for i in range(count)]}
        sets.append(HeldoutSet(name, windows, provenance))
    return sets


def without_timestamps(result: dict) -> dict:
    return {**result, "provenance": {k: v for k, v in result["provenance"].items() if k != "timestamp"}}


def test_several_sets_side_by_side_each_as_alone(tmp_path: Path, capsys) -> None:
    models = {"before": EmaUnigram(VOCAB, decay=0.0), "after": EmaUnigram(VOCAB, decay=0.95)}
    loads: list[str] = []

    def load(name: str) -> EmaUnigram:
        loads.append(name)
        return models[name]

    config = TrainConfig().replace(run="two", seq="12", bucket=4)
    sets = synthetic_sets()
    result = evaluate_sets(config, sets, load, "before", "after")
    assert loads == ["before", "after"]  # each model loaded once for all sets
    assert result["settings"]["heldout"] == ["fly", "human"] and len(result["sets"]) == 2
    for heldout, (name, one) in zip(sets, result_sets(result)):
        alone = evaluate_sets(config, [heldout], models.__getitem__, "before", "after")
        assert name == heldout.name and one["name"] == name
        assert without_timestamps({k: v for k, v in one.items() if k != "name"}) == without_timestamps(alone)
    assert result["sets"][0]["settings"]["windows"] == 4 and result["sets"][1]["settings"]["windows"] == 3

    paths = write_outputs(result, tmp_path)
    saved = json.loads(paths["json"].read_text())
    assert [s["name"] for s in saved["sets"]] == ["fly", "human"]
    with open(paths["csv"], newline="") as handle:
        rows = list(csv.DictReader(handle))
    expected = [(n, str(b)) for n in ("fly", "human") for b in range(3)]
    assert [(r["heldout"], r["bucket"]) for r in rows] == expected
    assert float(rows[4]["after_loss"]) == pytest.approx(saved["sets"][1]["buckets"][1]["after"]["loss"])
    assert paths["figure"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recomputed = recompute(paths["windows"])
    assert list(recomputed) == ["fly", "human"]
    for one in saved["sets"]:
        assert jsonable(recomputed[one["name"]]["buckets"]) == one["buckets"]
        assert jsonable(recomputed[one["name"]]["contrast"]) == one["contrast"]
    table = format_table(saved).splitlines()
    assert "fly" in table[0] and "human" in table[0]
    assert table[1].replace("|", "").split() == ["before", "after", "change"] * 2
    assert [line.split()[0] for line in table[3:6]] == ["0", "1", "2"] and table[7].split()[0] == "all"
    assert any(line.startswith("human: 3 windows") for line in table)

    with pytest.raises(EvalError, match="different lengths"):
        evaluate_sets(config, [sets[0], HeldoutSet("long", make_windows(2, 16), {})], load, "before", "after")


def test_heldout_folders() -> None:
    demo = TrainConfig().replace(genome="demo", seq="16k")
    assert heldout_folders(demo) == [Path("data/prepared/demo-16k")]
    assert heldout_folders(TrainConfig().replace(heldout="a, b/c")) == [Path("a"), Path("b/c")]
    with pytest.raises(EvalError, match="empty folder name"):
        heldout_folders(TrainConfig().replace(heldout="a,,b"))
    with pytest.raises(EvalError, match="a given twice"):
        heldout_folders(TrainConfig().replace(heldout="a,b,a"))


def test_eval_command_on_two_genomes(demo_outputs, tmp_path: Path, capsys) -> None:
    provenance = json.loads(demo_outputs[0].read_text())["provenance"]
    fly = provenance["data_dir"]
    human, human_256 = tmp_path / "human", tmp_path / "human-256"
    for out, seq in ((human, "128"), (human_256, "256")):
        argv = ["--fasta", str(HG38_FRAGMENTS), "--seq", seq, "--heldout", HG38_RECORDS[1], "--out", str(out)]
        assert data_main([*argv, "--no-progress"]) == 0
    picked = load_heldout(human, 2)
    assert picked.name == "human" and len(picked.windows) == 2
    assert picked.provenance["data_dir"] == str(human) and len(picked.provenance["windows"]) == 2
    for window, where in zip((picked.windows[0], picked.windows[1]), picked.provenance["windows"]):
        assert (window.index, window.record, window.start, window.end) == tuple(where.values())
        assert window.record == HG38_RECORDS[1] and window.source == "human" and window.strand == "+"
    run = [
        "run=demo",
        "seq=128",
        "model=tiny",
        "bucket=16",
        "eval_windows=3",
        f"results_dir={tmp_path}",
        "--before",
        provenance["before_model"],
        "--after",
        provenance["after_model"],
    ]
    assert main([*run, f"heldout={fly},{human}"]) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "demo" / "buckets.json").read_text())
    assert saved["settings"]["heldout"] == [Path(fly).name, "human"]
    assert [s["provenance"]["data_dir"] for s in saved["sets"]] == [fly, str(human)]
    assert all(s["settings"]["windows"] == 3 and len(s["buckets"]) == 8 for s in saved["sets"])
    assert saved["sets"][1]["provenance"]["windows"][0]["record"] == HG38_RECORDS[1]
    header = next(line for line in out.splitlines() if line.startswith("bucket"))
    assert Path(fly).name in header and "human" in header  # the printed table, side by side

    assert main([*run, f"heldout={fly},{human_256}"]) == 2
    err = capsys.readouterr().err
    assert "same --seq" in err and fly in err and str(human_256) in err

"""Bucket statistics, the before/after comparison, the context-cut scorer and the result writers."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch
from data_fixtures import build, write_fasta

from genomelm.commands.eval import main
from genomelm.data.vocab import BUILTIN, N
from genomelm.data.windows import Window
from genomelm.eval.buckets import bucket_sums, bucketed_loss
from genomelm.eval.evaluate import (
    EvalError,
    HeldoutSet,
    check_bucket,
    evaluate_sets,
    load_heldout,
    write_outputs,
)
from genomelm.eval.paired import WindowSums, summarise
from genomelm.eval.report import jsonable
from genomelm.eval.table import LEGEND, format_table
from genomelm.eval.window_table import recompute
from genomelm.run.config import TrainConfig
from genomelm.run.models import ModelChoiceError, model_pair
from genomelm.run.scoring import pick_windows, score_windows

# W=2 windows of S=5 positions, buckets of 2: [0, 2), [2, 4) and the uneven last one [4, 5)
LOSS = np.array([[1, 2, 3, 4, 5], [3, 6, 1, 9, 7]], dtype=np.float32)
VALID = np.array([[1, 1, 1, 0, 1], [1, 0, 1, 1, 0]], dtype=bool)
SOFT = np.array([[0, 1, 1, 0, 0], [1, 0, 0, 1, 0]], dtype=bool)
NAN = math.nan


def _check(row: dict, prefix: str, loss: float, se: float, tokens: int, windows: int) -> None:
    got = [row[prefix + k] for k in ("loss", "se", "tokens", "windows")]
    assert got == pytest.approx([loss, se, tokens, windows], nan_ok=True), (prefix, got)


def test_bucketed_loss_hand_computed() -> None:
    rows = bucketed_loss(LOSS, VALID, SOFT, bucket=2)
    assert [(r["start"], r["end"]) for r in rows] == [(0, 2), (2, 4), (4, 5)]
    # bucket 0: sums 3 (1 + 2) and 3 over 2 and 1 tokens (the loss 6 is not valid), mean R = 6 / 3 = 2;
    # residuals y - R x = -1, +1 over the total 3: s.e.^2 = 2 / 1 * ((1/3)^2 + (1/3)^2) = 4/9
    _check(rows[0], "", 2.0, 2 / 3, 3, 2)
    _check(rows[0], "repeat_", 2.5, 0.5, 2, 2)  # one token each: the s.e. of the two values' mean
    _check(rows[0], "unmasked_", 1.0, NAN, 1, 1)  # one window: no s.e.
    # bucket 1: sums 3 and 10 over 1 and 2 tokens, mean 13/3; residuals -4/3, +4/3 over 3: s.e. 8/9
    _check(rows[1], "", 13 / 3, 8 / 9, 3, 2)
    _check(rows[1], "repeat_", 6.0, 3.0, 2, 2)
    _check(rows[1], "unmasked_", 1.0, NAN, 1, 1)
    # uneven last bucket of one position: only window 0 has a valid, unmasked token
    _check(rows[2], "", 5.0, NAN, 1, 1)
    _check(rows[2], "repeat_", NAN, NAN, 0, 0)
    _check(rows[2], "unmasked_", 5.0, NAN, 1, 1)


def test_standard_error_is_the_token_weighted_means_own() -> None:
    # windows of 1, 1 and 2 tokens (sums 1, 2, 12): the token-weighted mean 15/4, not the mean of window
    # means 3; residuals y - R x = -2.75, -1.75, +4.5 over the total 4 tokens, times n / (n - 1) = 3/2
    loss = np.array([[1, 0], [2, 0], [5, 7]], dtype=np.float32)
    valid = np.array([[1, 0], [1, 0], [1, 1]], dtype=bool)
    (row,) = bucketed_loss(loss, valid, np.zeros_like(valid), bucket=2)
    se = math.sqrt(3 / 2 * (2.75**2 + 1.75**2 + 4.5**2) / 4**2)
    _check(row, "", 15 / 4, se, 4, 3)


def test_bucketed_loss_rejects_bad_shapes_and_buckets() -> None:
    with pytest.raises(ValueError, match="bucket"):
        bucketed_loss(LOSS, VALID, SOFT, bucket=6)
    with pytest.raises(ValueError, match="bucket"):
        bucketed_loss(LOSS, VALID, SOFT, bucket=0)
    with pytest.raises(ValueError, match=r"\[W, S\]"):
        bucketed_loss(LOSS, VALID[:1], SOFT, bucket=2)


def test_summarise_changes_per_bucket_and_overall() -> None:
    after_loss = LOSS / 2
    after_loss[:, 4] = LOSS[:, 4] * 1.5  # bucket 2 worse: 5 -> 7.5
    before = bucket_sums(LOSS, VALID, SOFT, bucket=2)
    out = summarise(WindowSums(before, bucket_sums(after_loss, VALID, SOFT, bucket=2)))
    assert [b["change"] for b in out["buckets"]] == pytest.approx([-0.5, -0.5, 0.5])
    assert out["buckets"][0]["change_nats"] == pytest.approx(-1.0)  # mean 2 -> 1
    assert math.isnan(out["buckets"][2]["repeat_change"])  # no repeat tokens there
    assert out["buckets"][2]["intervals"]["change"]["note"] == "1 window with tokens"
    # every window halves in buckets 0 and 1: the paired interval has no width and excludes 0
    interval = out["buckets"][0]["intervals"]["change"]
    assert interval["low"] == pytest.approx(-0.5) and interval["high"] == pytest.approx(-0.5)
    assert interval["excludes_zero"] and interval["windows"] == 2
    o = out["overall"]
    # token-weighted over buckets = mean over all 7 valid tokens
    assert o["loss_before"] == pytest.approx(LOSS[VALID].mean())
    assert o["loss_after"] == pytest.approx(after_loss[VALID].mean())
    assert o["change"] == pytest.approx(o["loss_after"] / o["loss_before"] - 1)
    assert o["tokens"] == 7 and o["repeat_tokens"] == 4 and o["unmasked_tokens"] == 3
    late = out["contrast"]["late_minus_early"]
    assert late["value"] == pytest.approx(1.0) and late["note"] == ""  # +50% minus -50%
    with pytest.raises(ValueError, match="different buckets"):
        WindowSums(before, bucket_sums(LOSS, VALID, SOFT, bucket=3))
    with pytest.raises(ValueError, match="different tokens"):
        WindowSums(before, bucket_sums(LOSS, ~VALID, SOFT, bucket=2))


def test_far_copies_are_a_subset_of_their_own() -> None:
    far = np.zeros_like(VALID)
    far[:, 2:4] = True  # positions 2 and 3 of both windows; position 3 of window 0 is not valid
    rows = bucketed_loss(LOSS, VALID, SOFT, bucket=2, far_copy=far)
    _check(rows[1], "far_", 13 / 3, 8 / 9, 3, 2)  # every valid token of bucket 1
    _check(rows[0], "far_", NAN, NAN, 0, 0)
    assert bucketed_loss(LOSS, VALID, SOFT, bucket=2)[1]["far_tokens"] == 0  # none without a mask


class EmaUnigram(torch.nn.Module):
    """Predicts token t+1 from counts of tokens 0..t decayed by `decay` per step: p ~ 0.5 + counts.

    decay=0 sees only the current token; decay=1 sees the whole context, so its loss depends on how
    much context it is given.
    """

    def __init__(self, vocab: int, decay: float) -> None:
        super().__init__()
        self.decay = decay
        self.prior = torch.nn.Parameter(torch.full((vocab,), 0.5))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        assert reduction == "none"
        onehot = torch.nn.functional.one_hot(input_ids, self.prior.numel()).float()  # [B, S, V]
        counts, steps = torch.zeros_like(onehot[:, 0]), []
        for t in range(input_ids.shape[1]):
            counts = self.decay * counts + onehot[:, t]
            steps.append(counts)
        p = torch.stack(steps, 1) + self.prior
        logp = p.log() - p.sum(-1, keepdim=True).log()
        nll = -logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        return torch.where(labels == -100, torch.zeros_like(nll), nll)


VOCAB = len(BUILTIN.code_to_id)  # token ids of the built-in vocabulary: pad, A, C, G, T, N


def make_windows(n: int, seq: int, seed: int = 0) -> list[Window]:
    """Synthetic held-out windows of the built-in vocabulary (bases A C G T, some N)."""
    g = torch.Generator().manual_seed(seed)
    windows = []
    for i in range(n):
        ids = torch.randint(1, 5, (seq,), generator=g)
        ids[: seq // 3] = 1  # a long run of one base early: long-memory models carry it forward
        ids[torch.rand(seq, generator=g) < 0.1] = N
        soft = torch.rand(seq, generator=g) < 0.4
        windows.append(Window("synthetic", i, "chrT", i * seq, (i + 1) * seq, ids, soft, BUILTIN))
    return windows


def evaluate(config: TrainConfig, windows: list[Window], models: dict, provenance: dict) -> dict:
    """The one-folder result of `windows` scored with models["before"] and models["after"]."""
    return evaluate_sets(
        config, [HeldoutSet("synthetic", windows, provenance)], models.__getitem__, "before", "after"
    )


def test_score_windows_full_context() -> None:
    model, windows = EmaUnigram(VOCAB, decay=0.9), make_windows(3, 10)
    scores = score_windows(model, windows, bucket=4, context_cut=False)
    assert scores.loss.dtype == np.float32 and scores.loss.shape == (3, 10) and scores.cut_loss is None
    for i, w in enumerate(windows):
        expected = model.loss(w.input_ids[None], w.labels[None])[0].detach().numpy()
        np.testing.assert_allclose(scores.loss[i], expected, rtol=1e-6)
        np.testing.assert_array_equal(scores.valid[i], (w.labels != -100).numpy())
        np.testing.assert_array_equal(scores.softmask[i, :-1], w.softmask[1:].numpy())  # the target's flag
        assert not scores.softmask[i, -1]
        assert np.all(scores.loss[i][~scores.valid[i]] == 0)
    assert not scores.valid.all()  # some next bases are N


def test_context_cut_scores_last_bucket_from_preceding_bucket_only() -> None:
    # S=10, bucket 4: buckets [0,4) [4,8) [8,10); the cut scores positions 8, 9 from input_ids[4:10]
    model, windows = EmaUnigram(VOCAB, decay=1.0), make_windows(2, 10)
    scores = score_windows(model, windows, bucket=4, context_cut=True)
    assert scores.cut_start == 8 and scores.cut_loss.shape == (2, 2)
    for i, w in enumerate(windows):
        part = model.loss(w.input_ids[None, 4:], w.labels[None, 4:])[0, 4:].detach().numpy()
        np.testing.assert_allclose(scores.cut_loss[i], part, rtol=1e-6)
    valid = scores.valid[:, 8:]
    assert not np.allclose(scores.cut_loss[valid], scores.loss[:, 8:][valid])  # long memory: the cut matters
    short = score_windows(EmaUnigram(VOCAB, decay=0.0), windows, bucket=4, context_cut=True)
    np.testing.assert_allclose(short.cut_loss, short.loss[:, 8:], rtol=1e-6)  # no memory: it does not


def test_context_cut_needs_two_buckets() -> None:
    with pytest.raises(ValueError, match="2 buckets"):
        score_windows(EmaUnigram(VOCAB, 0.5), make_windows(1, 8), bucket=8, context_cut=True)


def test_check_bucket_and_pick_windows() -> None:
    assert check_bucket(4, 10) == 3 and check_bucket(10, 10) == 1
    with pytest.raises(EvalError, match="larger than SEQ"):
        check_bucket(11, 10)
    with pytest.raises(EvalError, match="positive"):
        check_bucket(0, 10)
    assert pick_windows(10, 0) == list(range(10)) and pick_windows(3, 5) == [0, 1, 2]
    assert pick_windows(10, 4) == [0, 3, 6, 9]


def test_main_rejects_bucket_larger_than_seq(tmp_path, capsys) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run: t\nseq: 4096\n")
    assert main([str(config), "bucket=8192", f"results_dir={tmp_path}"]) == 2
    assert "larger than SEQ (4096 tokens)" in capsys.readouterr().err


def test_missing_checkpoint_says_to_train_first(tmp_path) -> None:
    config = TrainConfig().replace(run="t", runs_dir=str(tmp_path))
    with pytest.raises(ModelChoiceError, match="make train"):
        model_pair(config, before="base", after=None)


def run_synthetic_eval(folder, seq: int = 12, bucket: int = 4) -> dict:
    """A full before/after evaluation of synthetic windows with two tiny models; writes into `folder`."""
    models = {"before": EmaUnigram(VOCAB, decay=0.0), "after": EmaUnigram(VOCAB, decay=0.95)}
    config = TrainConfig().replace(run="synthetic", seq=str(seq), bucket=bucket, context_cut=True)
    windows = make_windows(4, seq)
    provenance = {
        "data_dir": "synthetic",
        "manifest": "synthetic/manifest.json",
        "windows": [{"index": w.index, "record": w.record, "start": w.start, "end": w.end} for w in windows],
    }
    result = evaluate(config, windows, models, provenance)
    write_outputs(result, folder)
    return result


def test_writers_json_csv_png_and_table(tmp_path, capsys) -> None:
    result = run_synthetic_eval(tmp_path, seq=10, bucket=4)
    capsys.readouterr()

    def no_nan(name: str) -> float:
        raise AssertionError(f"{name} in strict JSON")

    saved = json.loads((tmp_path / "buckets.json").read_text(), parse_constant=no_nan)
    assert saved["settings"] == {
        "run": "synthetic",
        "seq": 10,
        "bucket": 4,
        "buckets": 3,
        "windows": 4,
        "eval_windows": 0,
        "eval_far_copies": 0.0,
        "context_cut": True,
    }
    assert [(b["start"], b["end"]) for b in saved["buckets"]] == [(0, 4), (4, 8), (8, 10)]
    assert saved["overall"]["change"] == pytest.approx(result["overall"]["change"])
    assert saved["context_cut"]["start"] == 8 and saved["context_cut"]["context"] == 4
    assert saved["provenance"]["before_model"] == "before" and len(saved["provenance"]["windows"]) == 4
    assert not list(tmp_path.glob("*.tmp"))

    with open(tmp_path / "buckets.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3 and rows[2]["start"] == "8" and rows[2]["end"] == "10"
    for row, bucket in zip(rows, saved["buckets"]):
        assert float(row["before_loss"]) == pytest.approx(bucket["before"]["loss"])
        assert float(row["after_se"]) == pytest.approx(bucket["after"]["se"])
        assert float(row["change"]) == pytest.approx(bucket["change"])
        assert int(row["after_repeat_tokens"]) == bucket["after"]["repeat_tokens"]
        interval = bucket["intervals"]["change"]
        assert float(row["change_low"]) == pytest.approx(interval["low"])
        assert interval["low"] < float(row["change"]) < interval["high"]
        assert row["change_excludes_zero"] == str(interval["excludes_zero"])
        assert float(row["repeat_change_nats"]) == pytest.approx(bucket["repeat_change_nats"])

    assert (tmp_path / "loss_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = format_table(saved).splitlines()
    assert table[0].split()[:4] == ["bucket", "context", "(kb)", "tokens"]
    assert [line.split()[0] for line in table[2:5]] == ["0", "1", "2"] and table[6].split()[0] == "all"
    assert any(line.startswith("context cut") for line in table)
    assert table[8].startswith("windows: 4, spread evenly") and table[9] == LEGEND and "±" in table[2]
    bucket_2 = saved["buckets"][2]["intervals"]["change"]
    assert table[4].split("%")[0].endswith(f"± {50 * (bucket_2['high'] - bucket_2['low']):.2f}")
    assert any(line.startswith("late vs early: bucket 2's change minus bucket 0's") for line in table)


def test_every_number_recomputed_from_windows_csv(tmp_path, capsys) -> None:
    run_synthetic_eval(tmp_path, seq=10, bucket=4)
    saved = json.loads((tmp_path / "buckets.json").read_text())
    (recomputed,) = recompute(tmp_path / "windows.csv").values()
    for part in ("buckets", "overall", "context_cut", "contrast"):
        assert jsonable(recomputed[part]) == saved[part], part  # exact: the file keeps every float's digits
    assert saved["context_cut"]["intervals"]["change_full"]["windows"] == 4
    with open(tmp_path / "windows.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 4 * 3  # windows x buckets
    assert [(r["window"], r["record"], r["start"], r["end"]) for r in rows[:3]] == [
        ("0", "chrT", "0", "10")
    ] * 3
    assert rows[2]["before_cut_sum"] != "" and rows[1]["before_cut_sum"] == ""  # the cut: last bucket only
    broken = tmp_path / "broken.csv"
    broken.write_text("window,record\n0,chrT\n")
    with pytest.raises(ValueError, match="broken.csv: not a genomelm windows file"):
        recompute(broken)


def test_far_copy_rule_picks_windows_by_their_sequence_and_the_table_says_so(tmp_path) -> None:
    """eval_far_copies=x scores only held-out windows whose last bucket predicts >= x far-copy bases (the
    sequence alone decides), spread as without the rule; none qualifying is one clear error."""
    rng = np.random.default_rng(0)
    seq, n = 4096, 6
    bases = rng.choice(list("ACGT"), seq * n)
    for w in (1, 4):  # the last 1,024 bases of windows 1 and 4 repeat bases from 3 kb earlier in the window
        end = (w + 1) * seq
        bases[end - 1024 : end] = bases[end - 4096 : end - 3072]
    records = {"chrT": "".join(rng.choice(list("ACGT"), seq)), "chrH": "".join(bases)}
    folder, _ = build(
        tmp_path, write_fasta(tmp_path / "g.fa", records), train=["chrT"], heldout=["chrH"], seq="4k"
    )
    every = load_heldout(folder, 0)
    assert [w["index"] for w in every.provenance["windows"]] == list(range(n))
    chosen = load_heldout(folder, 0, min_far_copies=0.5, last=1024)
    assert [w["index"] for w in chosen.provenance["windows"]] == [1, 4]
    assert chosen.provenance["candidates"] == 2 and chosen.provenance["heldout_windows"] == n
    assert "last 1,024 positions predict >= 50.0% far copies" in chosen.provenance["rule"]
    one = load_heldout(folder, 1, min_far_copies=0.5, last=1024)
    assert [w["index"] for w in one.provenance["windows"]] == [1]
    with pytest.raises(EvalError, match=r"no held-out window has >= 99\.0% .* lower eval_far_copies="):
        load_heldout(folder, 0, min_far_copies=0.99, last=1024)

    models = {"before": EmaUnigram(VOCAB, decay=0.0), "after": EmaUnigram(VOCAB, decay=0.95)}
    config = TrainConfig().replace(run="r", seq="4096", bucket=1024, eval_far_copies=0.5)
    result = evaluate_sets(config, [chosen], models.__getitem__, "before", "after")
    assert result["settings"]["eval_far_copies"] == 0.5
    assert "windows: 2, spread evenly over held-out windows whose last 1,024 positions" in format_table(
        result
    )
    assert "(2 of 6 qualify)" in format_table(result)

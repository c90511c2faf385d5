"""`genomelm track`: per-base values at genome coordinates, the short context, a planted repeat, bad input,
and the command end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyBigWig
import pysam
import pytest
import torch
from data_fixtures import DMEL_RECORD, build, fly_windows, tiny_run, write_fasta
from test_data_twobit import write_2bit
from test_eval_buckets import EmaUnigram

from genomelm.cli import main as cli_main
from genomelm.commands.train import main as train_main
from genomelm.data import BUILTIN, WindowDataset
from genomelm.data.faidx import region_index
from genomelm.data.reference import read_reference
from genomelm.data.vocab import CODE_MASK, CODE_TABLE, SOFT_BIT
from genomelm.data.windows import Window
from genomelm.eval.evaluate import load_heldout
from genomelm.eval.tracks import (
    TRACKS,
    TrackError,
    TrackInput,
    cut_tokens,
    parse_region,
    plan_tracks,
    region_windows,
    run_tracks,
    short_context_crops,
    short_context_losses,
    track_files,
    write_tracks,
)
from genomelm.model import load_model
from genomelm.run.config import TrainConfig
from genomelm.run.scoring import token_losses

SEQ = 128
CODE = {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5}
VOCAB = len(BUILTIN.code_to_id)
HALF = 48  # the planted repeat: record "rep" is HALF random bases, the same again, then 32 more


def genome() -> dict[str, str]:
    """chrA (1,500 bases) and chrB (700) with lower-case and N runs; rep: a random half, its copy, a tail."""
    rng = np.random.default_rng(7)

    def random(n: int) -> list[str]:
        return list(rng.choice(list("ACGT"), n))

    a, b = random(1500), random(700)
    for seq, lower, ns in (
        (a, [(600, 700), (1100, 1120)], [(450, 460), (1300, 1305)]),
        (b, [(100, 150)], [(200, 203)]),
    ):
        for lo, hi in lower:
            seq[lo:hi] = [c.lower() for c in seq[lo:hi]]
        for lo, hi in ns:
            seq[lo:hi] = ["N"] * (hi - lo)
    half = random(HALF)
    return {"chrA": "".join(a), "chrB": "".join(b), "rep": "".join(half + half + random(32))}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A prepared folder of `genome()` at SEQ 128: held out chrA:429-684 (windows at 428 and 556) and
    chrB:1-128 (at 0), the rest for training; and the records' text."""
    root = tmp_path_factory.mktemp("tracks")
    records = genome()
    fasta = write_fasta(root / "genome.fa", records)
    folder, _ = build(root, fasta, "two", seq=SEQ, heldout=["chrA:429-684", "chrB:1-128"])
    return folder, records


def run_config(folder: Path, tmp_path: Path, **settings: object) -> TrainConfig:
    """Run "t" on the prepared `folder`, results under `tmp_path`, bucket 16 (the default short context)."""
    values = {"run": "t", "data": str(folder), "seq": str(SEQ), "results_dir": str(tmp_path), "bucket": 16}
    return TrainConfig().replace(**(values | settings))


def tracked(config: TrainConfig, models: dict[str, torch.nn.Module], folder: Path) -> tuple[dict, Path]:
    """`run_tracks` of the planned windows (held-out or the region's) with models["before"] and
    models["after"], written to tmp/tracks: (result, folder)."""
    plan = plan_tracks(config)
    if plan.regions is None:
        heldout = load_heldout(folder, 0)
        inputs = TrackInput(heldout.windows, plan.sizes, heldout.provenance)
    else:
        inputs = TrackInput(region_windows(plan.regions, plan.seq, plan.vocab), plan.sizes, {})
    result = run_tracks(config, inputs, models.__getitem__, "before", "after")
    out = config.results_path / "tracks"
    write_tracks(result, out)
    return result, out


def bigwig_values(path: Path) -> dict[tuple[str, int], float]:
    """(record, base) -> value of a per-base bigWig (every entry one base wide)."""
    bigwig = pyBigWig.open(str(path))
    try:
        out = {}
        for record in bigwig.chroms():
            for start, end, value in bigwig.intervals(record) or ():
                assert end == start + 1
                out[record, start] = value
        return out
    finally:
        bigwig.close()


def assert_same_values(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    keys = sorted(expected)
    np.testing.assert_allclose([got[k] for k in keys], [expected[k] for k in keys], rtol=1e-6, atol=1e-6)


class Unigram(torch.nn.Module):
    """No context at all: loss log 4 at every base."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        return torch.where(labels == -100, 0.0, torch.full(labels.shape, math.log(4)))


class CopyModel(Unigram):
    """Predicts base t + 1 perfectly (loss 0) when the `k` bases ending at t occurred earlier in its input
    and were followed by that base; else loss log 4. Its reach is its whole input."""

    def __init__(self, k: int = 8) -> None:
        super().__init__()
        self.k = k

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        ids, targets = input_ids[0].tolist(), labels[0].tolist()
        loss = torch.full((len(ids),), math.log(4))
        follower: dict[tuple[int, ...], int] = {}  # k-mer -> the base after its latest earlier occurrence
        for t in range(len(ids)):
            if t >= self.k:
                follower[tuple(ids[t - self.k : t])] = ids[t]
            if t + 1 >= self.k and follower.get(tuple(ids[t - self.k + 1 : t + 1])) == targets[t]:
                loss[t] = 0.0
        return torch.where(labels == -100, 0.0, loss[None])


class ContextCounter(Unigram):
    """Its 'loss' at position t is the number of tokens it read up to and including t."""

    def loss(self, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "none") -> torch.Tensor:
        return torch.arange(1, input_ids.shape[1] + 1, dtype=torch.float32)[None].expand(labels.shape)


def tiny(seed: int) -> torch.nn.Module:
    """The `tiny` preset, randomly initialised from `seed`."""
    torch.manual_seed(seed)
    return load_model("tiny").eval()


def test_bigwig_holds_token_losses_at_genome_coordinates(prepared, tmp_path: Path) -> None:
    folder, records = prepared
    config = run_config(folder, tmp_path, context_cut_tokens=48)  # one crop, [32, 128), kept from 96
    models = {"before": tiny(0), "after": EmaUnigram(VOCAB, decay=0.9)}
    result, out = tracked(config, models, folder)
    heldout = [WindowDataset(folder, "heldout")[i] for i in range(3)]
    assert [(w.record, w.start) for w in heldout] == [("chrA", 428), ("chrA", 556), ("chrB", 0)]
    expected: dict[str, dict] = {track: {} for track in TRACKS}
    with torch.no_grad():
        for w in heldout:
            labels = w.labels.numpy()
            full = {name: token_losses(model, w, "auto") for name, model in models.items()}
            # by the definition: position t >= 2c = 96 reads from s = min((t // 48 - 1) * 48, 128 - 96) = 32
            crop = {name: token_losses(model, w.cropped(32, 96), "auto") for name, model in models.items()}
            for t in np.flatnonzero(labels != -100):
                key = (w.record, w.start + t + 1)  # position t predicts the base after it
                for name in models:
                    short = crop[name][t - 32] if t >= 96 else full[name][t]
                    expected[name][key] = full[name][t]
                    expected[f"long_context_gain_{name}"][key] = short - full[name][t]
                expected["change"][key] = full["after"][t] - full["before"][t]
    for track in TRACKS:
        assert_same_values(bigwig_values(out / f"{track}.bw"), expected[track])
    before = bigwig_values(out / "before.bw")
    assert {("chrA", 429), ("chrA", 683), ("chrB", 1), ("chrB", 127)} <= before.keys()
    assert not {("chrA", 428), ("chrA", 556), ("chrB", 0)} & before.keys()  # the windows' first bases
    assert records["chrA"][450:460] == "N" * 10 and records["chrA"][460] in "ACGTacgt"
    assert not {("chrA", b) for b in range(450, 460)} & before.keys() and ("chrA", 460) in before
    assert all(result["summary"][t]["mean"] != 0 for t in ("change", "long_context_gain_after"))

    bigwig = pyBigWig.open(str(out / "after.bw"))
    assert bigwig.chroms() == {"chrA": 1500, "chrB": 700, "rep": len(records["rep"])}
    bigwig.close()
    lines = (out / "after.bedGraph").read_text().splitlines()
    assert lines[0].startswith('track type=bedGraph name="t after"')
    from_text = {(r, int(s)): float(v) for r, s, e, v in (line.split("\t") for line in lines[1:])}
    assert sorted(from_text) == sorted(expected["after"])
    np.testing.assert_allclose(
        [from_text[k] for k in sorted(from_text)],
        [expected["after"][k] for k in sorted(from_text)],
        rtol=1e-5,
    )

    masked = set()  # the soft-mask BED: the lower-case bases among those predicted
    for line in (out / "softmask.bed").read_text().splitlines()[1:]:
        record, start, end = line.split("\t")
        masked |= {(record, b) for b in range(int(start), int(end))}
    predicted = {(w.record, b) for w in heldout for b in range(w.start + 1, w.end)}
    assert masked == {(r, b) for r, b in predicted if records[r][b].islower()}
    assert {("chrA", 600), ("chrA", 683), ("chrB", 100), ("chrB", 127)} <= masked
    summary = json.loads((out / "tracks.json").read_text())
    assert summary["settings"]["context_cut_tokens"] == 48
    assert summary["summary"]["after"]["bases"] == len(expected["after"])


def test_short_context_reads_c_plus_1_to_2c_tokens() -> None:
    assert short_context_crops(100, 16) == [
        (16, slice(32, 48)),
        (32, slice(48, 64)),
        (48, slice(64, 80)),
        (64, slice(80, 96)),
        (68, slice(96, 100)),  # the last crop ends at the window's end
    ]
    ids = torch.randint(1, 5, (100,))
    window = Window("synthetic", 0, "chrT", 0, 100, ids, torch.zeros(100, dtype=torch.bool), BUILTIN)
    full = token_losses(ContextCounter(), window, "auto")
    np.testing.assert_array_equal(full, np.arange(1, 101))
    short = short_context_losses(ContextCounter(), window, 16, full, "auto")
    np.testing.assert_array_equal(short[:32], full[:32])  # reads at most 2c tokens anyway
    read = short[32:]
    assert read.min() == 17 and read.max() == 32  # c + 1 .. 2c tokens
    t = np.arange(32, 100)
    np.testing.assert_array_equal(read, t - np.minimum((t // 16 - 1) * 16, 100 - 32) + 1)

    config = TrainConfig().replace(bucket=16)
    assert cut_tokens(config, 100) == 16 and cut_tokens(config.replace(context_cut_tokens=8), 100) == 8
    with pytest.raises(
        TrackError, match=r"context_cut_tokens=50: .*give context_cut_tokens=24 \(at most 49\)"
    ):
        cut_tokens(config.replace(context_cut_tokens=50), 100)
    with pytest.raises(TrackError, match="bucket=64"):
        cut_tokens(config.replace(bucket=64), 100)


def test_planted_repeat_shows_a_long_context_gain_at_the_copy_only(prepared, tmp_path: Path) -> None:
    folder, records = prepared
    rep = records["rep"]
    assert rep[HALF : 2 * HALF] == rep[:HALF]
    config = run_config(folder, tmp_path, region="rep", context_cut_tokens=16)  # copy 48 back > 2c = 32
    result, out = tracked(config, {"before": Unigram(), "after": CopyModel(k=8)}, folder)
    gain, change = bigwig_values(out / "long_context_gain_after.bw"), bigwig_values(out / "change.bw")
    assert sorted(b for _, b in gain) == list(range(1, len(rep)))  # the whole record but its first base
    copy = range(HALF + 8, 2 * HALF)  # their 8-mer lies inside the copy
    assert all(gain["rep", b] == pytest.approx(math.log(4)) for b in copy)
    assert all(change["rep", b] == pytest.approx(-math.log(4)) for b in copy)  # the copy model finds it
    assert all(gain["rep", b] == 0 for b in range(1, HALF))  # nothing to find before the copy
    assert set(bigwig_values(out / "long_context_gain_before.bw").values()) == {0.0}  # no context, no gain
    assert result["summary"]["long_context_gain_after"]["mean"] > 0


def test_region_windows_read_the_source_at_genome_coordinates(prepared, tmp_path: Path) -> None:
    folder, records = prepared
    bed = tmp_path / "regions.bed"
    bed.write_text("track name=x\nchrA\t1000\t1400\n# the second record\nchrB\t299\t500\n")
    models = {"before": EmaUnigram(VOCAB, decay=0.9), "after": EmaUnigram(VOCAB, decay=0.5)}
    _, out = tracked(run_config(folder, tmp_path, region=str(bed), context_cut_tokens=16), models, folder)
    expected: dict[tuple[str, int], float] = {}
    for record, start, end in (("chrA", 1000, 1400), ("chrB", 299, 500)):
        text = records[record]
        for first in range(start - 1, end - 1, SEQ - 1):  # windows from the base before, stride SEQ - 1
            letters = text[first : min(first + SEQ, end)]
            ids = torch.zeros(SEQ, dtype=torch.long)
            ids[: len(letters)] = torch.tensor([CODE[c] for c in letters.upper()])
            labels = torch.full((SEQ,), -100)
            labels[:-1] = torch.where((ids[1:] == 0) | (ids[1:] == 5), -100, ids[1:])
            loss = models["before"].loss(ids[None], labels[None])[0].detach().numpy()
            for t in np.flatnonzero(labels.numpy() != -100):
                expected[record, first + t + 1] = loss[t]
    got = bigwig_values(out / "before.bw")
    assert_same_values(got, expected)
    assert {b for r, b in got if r == "chrA"} == set(range(1000, 1400)) - set(range(1300, 1305))
    assert {b for r, b in got if r == "chrB"} == set(range(299, 500))
    masked = [line.split("\t") for line in (out / "softmask.bed").read_text().splitlines()[1:]]
    assert masked == [["chrA", "1100", "1120"]]

    # "chr:start-end" is 1-based inclusive, and the same bases as the BED line
    sizes = plan_tracks(run_config(folder, tmp_path)).sizes
    (interval,) = parse_region("chrA:1001-1400", sizes, ["genome.fa"])
    assert (interval.record, interval.start, interval.end) == ("chrA", 1000, 1400)
    (whole,) = parse_region("chrB", sizes, ["genome.fa"])
    assert (whole.start, whole.end) == (0, 700)


def test_reference_reads_alike_streamed_indexed_and_twobit(tmp_path: Path) -> None:
    """Record lengths and region bases from a plain FASTA (streamed), a BGZF copy with its samtools index
    (read only where wanted) and a .2bit (its index; streamed when bases are wanted) are the same."""
    records = genome()
    fasta = write_fasta(tmp_path / "ref.fa", records)
    bgzf = tmp_path / "ref.fa.gz"
    pysam.tabix_compress(str(fasta), str(bgzf))
    pysam.faidx(str(bgzf))
    assert region_index(bgzf)[0] is not None
    twobit = write_2bit(tmp_path / "ref.2bit", records)
    wanted = {"chrA": [(1090, 1310)], "rep": [(0, 20)]}
    reads = [read_reference([path], wanted) for path in (fasta, bgzf, twobit)]
    scan = np.frombuffer(records["chrA"][1090:1310].encode(), dtype=np.uint8)
    for sizes, bases in reads:
        assert sizes == {"chrA": 1500, "chrB": 700, "rep": len(records["rep"])}
        assert sorted(bases) == [("chrA", 1090), ("rep", 0)]
        np.testing.assert_array_equal(bases["chrA", 1090] >= SOFT_BIT, (scan >= ord("a")))  # lower case
        np.testing.assert_array_equal(bases["chrA", 1090] & CODE_MASK, CODE_TABLE[scan])
    assert read_reference([twobit], {})[0] == reads[0][0]  # the index alone


def test_bins_average_the_predicted_bases(prepared, tmp_path: Path) -> None:
    folder, _ = prepared
    models = {"before": EmaUnigram(VOCAB, decay=0.9), "after": EmaUnigram(VOCAB, decay=0.5)}
    config = run_config(folder, tmp_path / "1", region="chrB")
    per_base = bigwig_values(tracked(config, models, folder)[1] / "after.bw")
    _, out = tracked(config.replace(results_dir=str(tmp_path / "3"), track_bin=3), models, folder)
    bigwig = pyBigWig.open(str(out / "after.bw"))
    entries = bigwig.intervals("chrB")
    bigwig.close()
    bins: dict[int, list[float]] = {}
    for (_, base), value in per_base.items():
        bins.setdefault(base // 3, []).append(value)
    assert [(s, e) for s, e, _ in entries] == [(3 * k, min(3 * k + 3, 700)) for k in sorted(bins)]
    assert entries[-1][:2] == (699, 700)  # the record's last bin: 700 = 233 x 3 + 1
    np.testing.assert_allclose([v for *_, v in entries], [np.mean(bins[k]) for k in sorted(bins)], rtol=1e-6)
    assert len(bins[66]) == 2 and len(bins[67]) == 1  # N bases 200-202 count in no mean


def test_a_base_two_windows_predict_takes_the_earlier_window() -> None:
    ids = torch.randint(1, 5, (10,))
    soft = torch.zeros(10, dtype=torch.bool)
    windows = [
        Window("synthetic", i, "chrT", start, start + 10, ids, soft, BUILTIN)
        for i, start in enumerate((0, 5))
    ]
    config = TrainConfig().replace(context_cut_tokens=2)
    models = {"before": ContextCounter(), "after": ContextCounter()}
    result = run_tracks(config, TrackInput(windows, {"chrT": 20}, {}), models.__getitem__, "before", "after")
    (values,) = result["records"]
    assert values.bases.tolist() == list(range(1, 15)) and values.valid.all()
    # ContextCounter's loss is the tokens read: base x is x tokens into window 0, x - 5 into window 1
    assert values.values["before"].tolist() == list(range(1, 10)) + [x - 5 for x in range(10, 15)]


def test_reverse_windows_are_refused(prepared, tmp_path: Path) -> None:
    folder, _ = prepared
    window = WindowDataset(folder, "heldout")[0].reverse_complement()
    inputs = TrackInput([window], {"chrA": 1500}, {})
    with pytest.raises(TrackError, match="reverse strand; the tracks hold forward-strand coordinates"):
        run_tracks(run_config(folder, tmp_path), inputs, lambda path: pytest.fail("loaded a model"), "a", "b")


@pytest.mark.parametrize(
    ("region", "messages"),
    [
        ("chrA:1-99999", ["region=chrA:1-99999: ends at base 99,999 but record chrA has 1,500 bases", "fix"]),
        ("chrA:1400-1501", ["ends at base 1,501"]),
        ("chrZ:1-10", ["region=chrZ:1-10: no record 'chrZ' in ", "genome.fa (records: chrA, chrB, rep)"]),
        ("bad.bed", ["bad.bed line 2: 'chrA\\t10' has 2 column(s)", "needs chrom, start and end"]),
        (
            "overlap.bed",
            ["overlap.bed line 1 (chrA:1-100) and ", "overlap.bed line 2 (chrA:51-200)", "merge them"],
        ),
        ("gone.bed", ["gone.bed: cannot read the BED file", "check the path"]),
    ],
)
def test_bad_regions_are_refused_and_nothing_is_written(
    prepared, tmp_path: Path, capsys, region: str, messages: list[str]
) -> None:
    folder, _ = prepared
    (tmp_path / "bad.bed").write_text("chrA\t0\t10\nchrA\t10\n")
    (tmp_path / "overlap.bed").write_text("chrA\t0\t100\nchrA\t50\t200\n")
    spec = str(tmp_path / region) if region.endswith(".bed") else region
    args = [
        f"data={folder}",
        f"seq={SEQ}",
        "bucket=16",
        "model=tiny",
        "run=r",
        f"results_dir={tmp_path / 'results'}",
    ]
    assert cli_main(["track", *args, f"region={spec}", "--before", "tiny", "--after", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("genomelm track: ") and all(m in err for m in messages), err
    assert not (tmp_path / "results").exists()


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> list[str]:
    """The `genomelm train` settings of a `tiny` run trained for 2 steps on 512-token fly windows (held out:
    bases 200,001-201,024, 2 windows)."""
    root = tmp_path_factory.mktemp("trained")
    settings = tiny_run(fly_windows(root / "data", "1-4096", 512), root / "runs")
    assert train_main(settings) == 0
    return settings


def test_track_command_end_to_end(trained_run: list[str], tmp_path: Path, capsys) -> None:
    run = [*trained_run, f"results_dir={tmp_path}", "context_cut_tokens=128", "eval_windows=1"]
    assert cli_main(["track", *run]) == 0  # the run's base model and its newest checkpoint
    out = capsys.readouterr().out
    folder = tmp_path / "r" / "tracks"
    assert f"wrote {folder}/" in out and "long_context_gain_after" in out
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(track_files())
    data = next(item.split("=", 1)[1] for item in trained_run if item.startswith("data="))
    first = WindowDataset(data, "heldout")[0]  # eval_windows=1 of 2: the first
    bases = int((first.labels != -100).sum())
    assert first.start == 200_000 and bases > 500
    for track in TRACKS:
        bigwig = pyBigWig.open(str(folder / f"{track}.bw"))
        assert bigwig.chroms() == {DMEL_RECORD: 1_348_131}
        entries = bigwig.intervals(DMEL_RECORD)
        assert len(entries) == bases and entries[0][0] == 200_001  # base 200,000 starts the window
        bigwig.close()
        assert len((folder / f"{track}.bedGraph").read_text().splitlines()) == 1 + bases
    summary = json.loads((folder / "tracks.json").read_text())
    assert summary["provenance"]["after_model"].endswith("checkpoints/step-0000002/model")
    assert summary["summary"]["change"]["mean"] == pytest.approx(
        summary["summary"]["after"]["mean"] - summary["summary"]["before"]["mean"], abs=1e-5
    )

    assert cli_main(["track", *run, f"region={DMEL_RECORD}:300001-300200", "track_bin=10"]) == 0
    bigwig = pyBigWig.open(str(folder / "after.bw"))
    entries = bigwig.intervals(DMEL_RECORD)
    bigwig.close()
    assert [(s, e) for s, e, _ in entries] == [(s, s + 10) for s in range(300_000, 300_200, 10)]
    summary = json.loads((folder / "tracks.json").read_text())
    assert summary["settings"]["region"] == f"{DMEL_RECORD}:300001-300200"
    assert summary["provenance"]["windows"] == [{"record": DMEL_RECORD, "start": 299_999, "end": 300_200}]


@pytest.mark.slow  # 4 local ranks
def test_track_on_dp2_cp2_equals_one_process(trained_run: list[str], tmp_path: Path, capsys) -> None:
    """The windows split over 2 replicas, each window over 2 context-parallel ranks: the same tracks."""
    for name, mesh in (("one", []), ("mesh", ["dp=2", "cp=2"])):
        run = [*trained_run, f"results_dir={tmp_path / name}", "context_cut_tokens=128", *mesh]
        assert cli_main(["track", *run]) == 0
    capsys.readouterr()
    for track in TRACKS:
        one, mesh = (
            bigwig_values(tmp_path / name / "r" / "tracks" / f"{track}.bw") for name in ("one", "mesh")
        )
        assert sorted(mesh) == sorted(one) and len(one) > 1000  # both held-out windows
        np.testing.assert_allclose([mesh[k] for k in sorted(one)], [one[k] for k in sorted(one)], atol=1e-5)

"""Training-data options on real DNA: reverse complement, rebuilt labels, blends of datasets, crop warm-up."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from Bio.Seq import reverse_complement as bio_reverse_complement
from data_fixtures import DMEL, DMEL_RECORD, HG38_FRAGMENTS, HG38_RECORDS, build, read_records, write_fasta

from genomelm.data import DataError, Vocabulary, WindowDataset
from genomelm.data.augment import BlendedOrder, check_compatible, crop_length, parse_blend
from genomelm.data.tokens import labels_for, predicted_softmask, reverse_complement

LETTER_CODE = {"-": 0, "A": 1, "C": 2, "G": 3, "T": 4, "N": 5}
TOKENIZER_VOCAB = Vocabulary(code_to_id=(0, 7, 8, 9, 10, 11), vocab_size=12, tokenizer="test")


@pytest.fixture(scope="module")
def dmel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Fly chr4 windows of 4096 bases: train 1,196,001-1,204,192 runs into the 17 kb N run at 1,200,663."""
    tmp = tmp_path_factory.mktemp("augment")
    return build(
        tmp,
        DMEL,
        seq=4096,
        train=[f"{DMEL_RECORD}:1196001-1204192"],
        heldout=[f"{DMEL_RECORD}:300001-308192"],
        max_n_fraction=1.0,
    )[0]


def ids_of(letters: str, vocab: Vocabulary) -> torch.Tensor:
    return torch.tensor([vocab.code_to_id[LETTER_CODE[c.upper()]] for c in letters])


def letters_of(ids: torch.Tensor, softmask: torch.Tensor, vocab: Vocabulary) -> str:
    """Sequence text of a window: upper case, lower where soft-masked, '-' for padding."""
    letter = {token_id: "-ACGTN"[code] for code, token_id in enumerate(vocab.code_to_id)}
    return "".join(letter[i].lower() if m else letter[i] for i, m in zip(ids.tolist(), softmask.tolist()))


def expected_labels(letters: str, vocab: Vocabulary) -> list[int]:
    """Independent labels: id of the next letter, -100 where it is N or padding, and at the end."""
    ids = ids_of(letters, vocab).tolist()
    return [-100 if letters[t + 1].upper() in "N-" else ids[t + 1] for t in range(len(letters) - 1)] + [-100]


def test_reverse_complement_matches_biopython(dmel: Path) -> None:
    for split in ("train", "heldout"):
        ds = WindowDataset(dmel, split)
        for i in range(len(ds)):
            window, letters = ds[i], ds.letters(i)
            ids, mask = reverse_complement(window.ids, window.softmask, ds.vocab)
            assert letters_of(ids, mask, ds.vocab) == bio_reverse_complement(letters)  # case = soft-mask
            assert torch.equal(
                labels_for(ids, ds.vocab),
                torch.tensor(expected_labels(letters_of(ids, mask, ds.vocab), ds.vocab)),
            )
            other = window.reverse_complement()
            assert other.strand == "-" and other.reverse and not window.reverse
            assert torch.equal(other.input_ids, ids) and torch.equal(other.softmask, mask)
            assert torch.equal(other.labels, labels_for(ids, ds.vocab))
            back = other.reverse_complement()
            assert back.strand == "+" and torch.equal(back.ids, window.ids)
    train = WindowDataset(dmel, "train")
    assert Counter(train.letters(1).upper())["N"] > 1000 and any(c.islower() for c in train.letters(0))


def test_reverse_complement_twice_is_identity_and_leaves_input(dmel: Path) -> None:
    ds = WindowDataset(dmel, "train")
    for i in range(len(ds)):
        window = ds[i]
        original = window.ids.clone(), window.softmask.clone()
        once = reverse_complement(window.ids, window.softmask, ds.vocab)
        twice = reverse_complement(*once, ds.vocab)
        assert torch.equal(twice[0], original[0]) and torch.equal(twice[1], original[1])
        assert not torch.equal(once[0], original[0])
        assert torch.equal(window.ids, original[0])  # the input is not modified


def test_labels_rebuilt_as_the_dataset_builds_them(dmel: Path) -> None:
    for split in ("train", "heldout"):
        ds = WindowDataset(dmel, split)
        for i in range(len(ds)):
            window = ds[i]
            assert window.labels.tolist() == expected_labels(ds.letters(i), ds.vocab)
            assert torch.equal(labels_for(window.input_ids, ds.vocab), window.labels)


def test_window_crop_predicted_softmask_and_weights(dmel: Path) -> None:
    window = WindowDataset(dmel, "train")[0]
    soft = window.softmask
    assert soft.any() and not soft.all()
    predicted = predicted_softmask(soft)
    assert torch.equal(predicted[:-1], soft[1:]) and not predicted[-1]  # position t predicts base t + 1
    assert torch.equal(window.predicted_softmask, predicted)
    crop = window.cropped(128, 64)
    assert torch.equal(crop.input_ids, window.ids[128:192])
    assert torch.equal(crop.labels, window.labels[128:192]) and crop.labels[-1] == window.ids[192]  # no -100
    assert torch.equal(crop.predicted_softmask, predicted[128:192])
    assert torch.equal(window.cropped(4000).input_ids, window.ids[4000:])
    valid = window.labels != -100
    assert torch.equal(
        window.loss_weights(), valid.float()
    )  # softmask_weight 1: every real base weighs the same
    expected = torch.where(predicted, 0.25, 1.0).masked_fill(~valid, 0.0)
    torch.testing.assert_close(window.loss_weights(0.25), expected)
    torch.testing.assert_close(window.cropped(128, 64).loss_weights(0.25), expected[128:192])
    with pytest.raises(ValueError, match="ids of shape"):
        window.with_ids(window.ids[:10])


def test_padding_stays_at_the_end_and_tokenizer_ids(tmp_path: Path) -> None:
    dna = read_records(HG38_FRAGMENTS)[HG38_RECORDS[1]]
    fasta = write_fasta(
        tmp_path / "short.fa", {"long": dna[:3000], "tiny": dna[3000:3700], "held": dna[4000:6048]}
    )
    out, _ = build(tmp_path, fasta, seq=2048, heldout=["held"], allow_short=True)
    ds = WindowDataset(out, "train")
    padded = ds.letters(1)  # "long" gives one window, "tiny" the padded one
    assert padded.endswith("-" * 1348) and len(padded.rstrip("-")) == 700
    for vocab in (ds.vocab, TOKENIZER_VOCAB):
        ids, mask = reverse_complement(
            ids_of(padded, vocab), torch.tensor([c.islower() for c in padded]), vocab
        )
        assert letters_of(ids, mask, vocab) == bio_reverse_complement(padded[:700]) + "-" * 1348
        assert labels_for(ids, vocab).tolist() == expected_labels(letters_of(ids, mask, vocab), vocab)
        assert labels_for(ids, vocab)[699:].eq(-100).all()
    with pytest.raises(ValueError, match="not bases of this vocabulary"):
        reverse_complement(torch.tensor([7, 1, 8]), torch.zeros(3, dtype=torch.bool), TOKENIZER_VOCAB)
    with pytest.raises(ValueError, match=r"\[S\] alike"):
        reverse_complement(torch.tensor([7, 8]), torch.zeros(3, dtype=torch.bool), TOKENIZER_VOCAB)


def test_parse_blend() -> None:
    assert parse_blend("dirA:0.7,dirB:0.3") == [("dirA", pytest.approx(0.7)), ("dirB", pytest.approx(0.3))]
    assert parse_blend("data/prepared/x") == [("data/prepared/x", 1.0)]
    assert parse_blend("a:3, b") == [("a", 0.75), ("b", 0.25)]
    for bad, message in (
        ("", "empty folder"),
        ("a,,b", "empty folder"),
        ("a:x", "'x' of 'a:x' is not a number"),
        ("a:0", "positive"),
        ("a:-1,b", "positive"),
        ("a:nan", "positive"),
        (":0.5", "no folder"),
        ("a:1,a:2", "given twice"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_blend(bad)


def test_blended_order_shares_epochs_and_exact_resume() -> None:
    counts, weights = [5, 3, 7], [0.5, 0.2, 0.3]
    order = BlendedOrder(counts, weights, seed=11)
    draws = [order.next() for _ in range(200)]
    scaled = BlendedOrder(counts, [5, 2, 3], seed=11)  # weights are normalised
    assert [scaled.next() for _ in range(200)] == draws
    for k in range(1, 201):  # every prefix is within one draw of its share
        seen = Counter(d for d, _ in draws[:k])
        assert all(abs(seen[i] - w * k) <= 1 for i, w in enumerate(weights)), k
    for i, count in enumerate(counts):  # each epoch of a dataset visits each of its windows once
        windows = [w for d, w in draws if d == i]
        for epoch in range(len(windows) // count):
            assert sorted(windows[epoch * count : (epoch + 1) * count]) == list(range(count))
    assert draws != [BlendedOrder(counts, weights, seed=12).next() for _ in range(200)]

    interrupted = BlendedOrder(counts, weights, seed=11)
    head = [interrupted.next() for _ in range(77)]
    saved = json.loads(json.dumps(interrupted.state()))  # as a checkpoint stores it
    resumed = BlendedOrder(counts, weights, seed=11)
    resumed.load(saved)
    assert head + [resumed.next() for _ in range(123)] == draws
    with pytest.raises(ValueError, match="same data="):
        BlendedOrder([5, 3], [1, 1], seed=11).load(saved)


def test_blended_order_single_dataset_is_the_trainers_order() -> None:
    order = BlendedOrder([6], [1.0], seed=1234)
    draws = [order.next() for _ in range(12)]
    expected = [torch.randperm(6, generator=torch.Generator().manual_seed(1234 + e)).tolist() for e in (0, 1)]
    assert draws == [(0, w) for w in expected[0] + expected[1]]
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedOrder([6, 2], [1.0], seed=0)
    with pytest.raises(ValueError, match="every dataset needs windows"):
        BlendedOrder([6, 0], [1.0, 1.0], seed=0)


def test_check_compatible_names_both_folders(dmel: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    same, _ = build(
        tmp_path,
        DMEL,
        name="same",
        seq=4096,
        train=[f"{DMEL_RECORD}:1-8192"],
        heldout=[f"{DMEL_RECORD}:8193-16384"],
    )
    manifests = check_compatible([dmel, same])
    assert [m["seq_len"] for m in manifests] == [4096, 4096]
    other_seq, _ = build(
        tmp_path,
        DMEL,
        name="seq2k",
        seq=2048,
        train=[f"{DMEL_RECORD}:1-4096"],
        heldout=[f"{DMEL_RECORD}:4097-8192"],
    )
    with pytest.raises(DataError, match="same seq=") as err:
        check_compatible([dmel, other_seq])
    assert str(dmel) in str(err.value) and str(other_seq) in str(err.value)

    tok = Tokenizer(
        models.WordLevel(
            {"<pad>": 0, "<unk>": 1, "A": 7, "C": 8, "G": 9, "T": 10, "N": 11}, unk_token="<unk>"
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(
        tmp_path / "tok"
    )
    other_vocab, _ = build(
        tmp_path,
        DMEL,
        name="tok_ids",
        seq=4096,
        train=[f"{DMEL_RECORD}:1-8192"],
        heldout=[f"{DMEL_RECORD}:8193-16384"],
        tokenizer=str(tmp_path / "tok"),
    )
    with pytest.raises(DataError, match="different vocabularies") as err:
        check_compatible([same, other_vocab])
    assert str(same) in str(err.value) and str(other_vocab) in str(err.value)
    with pytest.raises(DataError, match="not a complete prepared dataset"):
        check_compatible([dmel, tmp_path / "missing"])


def test_crop_length_doubles_to_seq_at_warmup() -> None:
    # seq 1024 from 64: four stages (64, 128, 256, 512) of 2 steps each in 8 warm-up steps, then 1024
    assert [crop_length(s, 8, 1024, 64) for s in range(10)] == [
        64,
        64,
        128,
        128,
        256,
        256,
        512,
        512,
        1024,
        1024,
    ]
    lengths = [crop_length(s, 1000, 1 << 20, 1000) for s in range(1001)]
    assert lengths[0] == 1024 and lengths[999] == 1 << 19 and lengths[1000] == 1 << 20  # 1000 -> 1024
    assert lengths == sorted(lengths) and all(n % 64 == 0 for n in lengths)
    assert len(set(lengths)) == 11  # 1024 .. 2**19 (10 stages), then the full window
    assert crop_length(0, 0, 4096, 64) == 4096 and crop_length(3, 10, 100, 200) == 100
    with pytest.raises(ValueError, match="minimum >= 1"):
        crop_length(0, 10, 4096, 0)

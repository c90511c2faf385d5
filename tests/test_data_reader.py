"""WindowDataset / as_hf_dataset: windows and rows, labels and -100 rules, vocabulary map, memory-mapping."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from data_fixtures import DMEL, HG38_FRAGMENTS, HG38_RECORDS, build, read_records, write_fasta

from genomelm.data import DataError, WindowDataset, as_hf_dataset

FRAG = read_records(HG38_FRAGMENTS)[HG38_RECORDS[1]]


@pytest.fixture(scope="module")
def with_n(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real DNA with an N run and single Ns, split into two records."""
    tmp = tmp_path_factory.mktemp("reader")
    dna = FRAG[:500] + "N" * 40 + FRAG[540:1500] + "n" + FRAG[1501:3000]
    return build(tmp, write_fasta(tmp / "n.fa", {"a": dna, "b": FRAG[3000:5000]}), seq=1024, heldout=["b"])[0]


def test_item_fields_and_labels(with_n: Path) -> None:
    ds = WindowDataset(with_n, "train")
    assert len(ds) == 2 and ds.seq_len == 1024 and ds.vocab.code_to_id == (0, 1, 2, 3, 4, 5)
    item = ds[0]
    assert item.input_ids.dtype == torch.long and item.input_ids.shape == (1024,)
    assert torch.equal(item.input_ids, item.ids)  # the whole window
    assert item.softmask.dtype == torch.bool
    assert (item.source, item.index, item.strand, item.vocab) == (with_n.name, 0, "+", ds.vocab)
    assert (item.record, item.start, item.end) == ("a", 0, 1024)
    ids, labels = item.input_ids, item.labels
    assert labels[-1] == -100
    next_is_n = ids[1:] == 5
    assert torch.equal(labels[:-1][~next_is_n], ids[1:][~next_is_n])
    assert (labels[:-1][next_is_n] == -100).all() and int(next_is_n.sum()) == 40
    assert (labels[499:539] == -100).all() and labels[539] == ids[540]
    second = ds[1]  # the soft-masked 'n' at 1-based 1501 is N too, and soft-masked
    assert second.labels[1499 - 1024] == -100 and second.softmask[1500 - 1024]
    letters = ds.letters(0)
    assert torch.equal(item.softmask, torch.tensor([c.islower() for c in letters]))


def test_hf_dataset_rows_agree(with_n: Path, tmp_path: Path) -> None:
    for split in ("train", "heldout"):
        ds = WindowDataset(with_n, split)
        hf = as_hf_dataset(with_n, split, cache_dir=str(tmp_path / "hf"))
        assert len(hf) == len(ds)
        for i, row in enumerate(hf):
            item = ds[i]
            for key in ("input_ids", "labels", "softmask"):
                assert row[key] == getattr(item, key).tolist(), key
            assert row["position"] == list(range(ds.seq_len))
            assert (row["record"], row["start"], row["end"]) == (item.record, item.start, item.end)


def test_tokenizer_vocabulary_map(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def save(vocab: dict[str, int], name: str) -> Path:
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>")
        fast.save_pretrained(tmp_path / name)
        return tmp_path / name

    full = save({"<pad>": 0, "<unk>": 1, "AC": 2, "A": 7, "C": 8, "G": 9, "T": 10, "N": 11}, "full")
    fasta = write_fasta(tmp_path / "g.fa", {"a": FRAG[:2048], "b": FRAG[2048:3072]})
    out, _ = build(tmp_path, fasta, seq=1024, heldout=["b"], tokenizer=str(full))
    ds = WindowDataset(out, "train")
    assert ds.vocab.code_to_id == (0, 7, 8, 9, 10, 11) and ds.manifest["vocab"]["tokenizer"] == str(full)
    expected = torch.tensor([{"A": 7, "C": 8, "G": 9, "T": 10, "N": 11}[c] for c in FRAG[:1024].upper()])
    assert torch.equal(ds[0].input_ids, expected)
    assert ds.codes(0).dtype == np.uint8  # on disk it stays base codes
    no_n = save({"<pad>": 0, "<unk>": 1, "A": 7, "C": 8, "G": 9, "T": 10}, "no_n")
    with pytest.raises(DataError, match="no single-letter token for N"):
        build(tmp_path, fasta, name="bad", seq=1024, heldout=["b"], tokenizer=str(no_n))
    assert not (tmp_path / "bad").exists()


def test_opening_is_memory_mapped(tmp_path: Path) -> None:
    dna = gzip.decompress(DMEL.read_bytes()).split(b"\n", 1)[1]  # 1.37 MB of sequence lines
    fasta = tmp_path / "big.fa"
    with open(fasta, "wb") as out:
        out.write(b">big\n" + dna * 24 + b">held\n" + dna[:1_200_000] + b"\n")
    folder, _ = build(tmp_path, fasta, seq="1M", heldout=["held"], max_n_fraction=1.0)
    process = psutil.Process()
    before = process.memory_info().rss
    ds = WindowDataset(folder, "train")
    assert len(ds) == 30 and (folder / "train.bin").stat().st_size == 30 << 20
    assert process.memory_info().rss - before < 8 << 20  # 62 MB of tokens + soft-mask on disk

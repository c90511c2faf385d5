"""`key=value` for `genomelm data` and `genomelm export` (the old `--flags` read with a deprecation line),
`python -m genomelm`, and the shipped configs found from any folder (`genomelm.resources`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from genomelm import resources
from genomelm.commands import data
from genomelm.commands.keyvalue import ArgumentError, parse
from genomelm.model.config import PRESET_DIR
from genomelm.run.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def data_config(argv: list[str]):
    args = parse(argv, data.OPTIONS, data.PROG)
    if args.positional:
        args.settings["config"] = args.positional[0]
    args.settings.pop("progress", None)
    return data.resolve_config(args.settings)


def test_key_value_and_the_old_flags_give_the_same_data_settings(capsys) -> None:
    new = data_config(
        [
            "fasta=a.fa,b.fa",
            "seq=1k",
            "train=chr1,chr2",
            "heldout=chr3",
            "allow_short=true",
            "max-n-fraction=0.2",
        ]
    )
    assert capsys.readouterr().err == ""
    old = data_config(
        ["--fasta", "a.fa", "--fasta=b.fa", "--seq", "1k", "--train", "chr1,chr2", "--heldout=chr3",
         "--allow-short", "--max-n-fraction", "0.2"]
    )  # fmt: skip
    assert new == old
    assert (new.fasta, new.seq, new.train, new.allow_short, new.genome) == (
        ["a.fa", "b.fa"], 1024, ["chr1", "chr2"], True, "a"
    )  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert "genomelm data: --fasta is deprecated; write fasta=a.fa" in err
    assert "genomelm data: --allow-short is deprecated; write allow_short=true" in err
    assert len(err) == 7  # one line per old flag given


def test_a_data_config_as_first_argument_and_no_progress(capsys) -> None:
    parsed = parse(["configs/data/demo.yaml", "--no-progress"], data.OPTIONS, data.PROG)
    assert parsed.positional == ["configs/data/demo.yaml"] and parsed.settings == {"progress": "false"}
    assert "write progress=false" in capsys.readouterr().err
    config = data_config([str(ROOT / "configs/data/demo.yaml"), "seq=2k"])
    assert (config.genome, config.seq, config.heldout) == ("demo", 2048, ["NC_004353.4:1000001-1348131"])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["sequence=16k"], "unknown setting 'sequence'"),
        (["--sequence", "16k"], "unknown option --sequence"),
        (["--seq"], "--seq needs a value: write seq=VALUE"),
    ],
)
def test_a_bad_argument_is_named(argv: list[str], says: str) -> None:
    with pytest.raises(ArgumentError, match=says):
        parse(argv, data.OPTIONS, data.PROG)


def test_genomelm_data_refuses_a_bad_setting_as_one_line(capsys) -> None:
    assert data.main(["allow_short=maybe"]) == 2
    assert capsys.readouterr().err == "genomelm data: error: allow_short=maybe: give true or false\n"
    assert data.main(["--help"]) == 0
    assert "seq=VALUE" in capsys.readouterr().out


def test_python_dash_m_genomelm(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "genomelm", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "usage: genomelm <stage>" in done.stdout


def test_shipped_configs_are_found_from_any_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resources.root() == ROOT and PRESET_DIR == ROOT / "configs" / "model"
    assert resources.shipped("configs/train/demo.yaml") == ROOT / "configs/train/demo.yaml"
    assert resources.shipped("nothing.yaml") == Path("nothing.yaml")
    # the shipped demo config's pretrained model, found from here; a user's config is read from where it runs
    assert TrainConfig.load("configs/train/demo.yaml").model == str(ROOT / "data" / "models" / "demo-fly4")
    (tmp_path / "mine.yaml").write_text("model: data/models/demo-fly4\n")
    with pytest.raises(ValueError, match="model=data/models/demo-fly4: no such checkpoint folder"):
        TrainConfig.load("mine.yaml")
    config = data_config(["genome=demo"])  # configs/data/demo.yaml and its genome, from the checkout
    assert config.fasta == [str(ROOT / "data" / "dmel_chr4.fa.gz")]
    assert data_config(["configs/data/demo.yaml", "seq=4k"]).fasta == config.fasta

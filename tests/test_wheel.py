"""A wheel built from the repository installs into a fresh virtual environment and runs from an empty folder:
`genomelm data` finds the shipped demo config and genome, `python -m genomelm train configs/train/demo.yaml`
the shipped run config and the pretrained demo model it names (data/models/demo-fly4), for one step.

The fresh environment gets its dependencies (torch and the rest) from the test's own environment through a
`.pth` line, so nothing is downloaded; genomelm itself comes only from the wheel (checked)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300
SKIPPED = ("build", "dist", "runs", "results", "wandb", "prepared", "cache", "__pycache__", "*.egg-info")


def run(command: list[str], cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
    )
    assert done.returncode == 0, (
        f"{command} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout + done.stderr


@pytest.mark.slow  # ~20 s alone on 2 cores, ~70 s beside other tests
def test_a_wheel_installs_into_a_fresh_venv_and_runs_data_and_a_demo_step(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the in-tree build would write build/ and *.egg-info here
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", ".*_cache", *SKIPPED), symlinks=True
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "GENOMELM"))}
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source),
         "-w", str(wheels)], tmp_path, env)  # fmt: skip
    (wheel,) = wheels.glob("genomelm-*.whl")

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env)
    python = venv / "bin" / "python"
    purelib = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], tmp_path, env
        ).strip()
    )
    (purelib / "shared-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        tmp_path,
        env,
    )

    work = tmp_path / "empty"
    work.mkdir()
    where = run([str(python), "-c", "import genomelm; print(genomelm.__file__)"], work, env)
    assert where.strip().startswith(str(venv)), where  # the wheel's copy, not the checkout
    assert "stages:" in run([str(python), "-m", "genomelm", "--help"], work, env)
    run([str(venv / "bin" / "genomelm"), "data", "seq=2k", "progress=false"], work, env)
    manifest = json.loads((work / "data" / "prepared" / "demo-2k" / "manifest.json").read_text())
    assert manifest["sources"][0]["md5"] == "c5cbad4ce904a5f7d1618da270fa75ed"  # the shipped fly genome
    settings = ["seq=2k", "steps=1", "save_every=1", "warmup_steps=0", "wandb=disabled"]
    out = run([str(python), "-m", "genomelm", "train", "configs/train/demo.yaml", *settings], work, env)
    assert "trained demo: steps 0..1" in out, out
    assert f"model {venv / 'share' / 'genomelm' / 'data' / 'models' / 'demo-fly4'}: " in out, out
    assert (work / "runs" / "demo" / "checkpoints" / "step-0000001" / "model" / "config.json").is_file()

"""Run configuration shared by `genomelm train` and `genomelm eval`.

A run is described by a YAML file in `configs/train/` plus `key=value` overrides from the command line
(`genomelm train configs/train/hg38-512k.yaml steps=10 seq=1M`). Every run writes under
`runs/<run>/` (checkpoints, metrics) and `results/<run>/` (evaluation tables and figures).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from genomelm.data.regions import parse_seq, seq_label


@dataclass
class TrainConfig:
    """Everything a training or evaluation run needs. Token counts are per window (one micro-batch row)."""

    run: str = "run"  # name: runs/<run>/ and results/<run>/
    genome: str = "hg38"  # prepared data lives in data/prepared/<genome>-<seq>/ unless `data` is set
    seq: str = "512k"
    data: str | None = None  # prepared-data folder, or a weighted blend of several: dirA:0.7,dirB:0.3
    model: str | None = "glm-5.3-flash"  # checkpoint folder or preset name (the hg38 configs need a folder)
    allow_random_init: bool = False  # allow a preset of over 1B parameters (random weights: benchmarks only)
    # optimisation
    steps: int = 0  # optimizer steps; 0: from `epochs`
    epochs: float = 1.0  # passes over the training windows when steps = 0
    lr: float = 1e-5
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    grad_accum: int = 1  # windows per optimizer step
    seed: int = 1234
    # parallelism and launch
    cp: int = 1  # context parallel: ranks one window is split over
    cp_layout: str = "zigzag"  # "zigzag" (balanced indexer work) or "contiguous"
    dp: int = 1  # data parallel: each of dp replicas reads its own windows (processes: dp * cp)
    ep: int = 1  # expert parallel: the routed experts split over ep of the dp * cp ranks (ep divides dp * cp)
    fsdp: bool = True  # with more than one process: FSDP2 shards parameters, gradients and optimizer state
    optimizer_offload: bool = False  # AdamW state and fp32 master weights in host memory (FSDP2, GPUs only)
    ep_capacity_factor: float = 8.0  # refuse an MoE exchange giving a rank more than this x the mean tokens
    launcher: str = "local"  # "local" (processes on this machine) or "ray" (Ray Train workers)
    ray_address: str | None = None  # an existing Ray cluster ("auto", "ray://host:10001"); none: a local Ray
    max_failures: int = 0  # worker failures Ray restarts the group after (from the last checkpoint)
    fault_at_step: int = 0  # test knob: rank `fault_rank` exits hard after this step, once per run (0 = off)
    fault_rank: int = 0
    # planning (`genomelm plan`)
    gpus: int = 0  # GPUs to plan for (0: dp * cp * ... of the run)
    gpu: str = "b200"  # "b200" (178 GiB usable) or "h200" (139 GiB)
    search: bool = False  # plan every layout that fits and rank them by projected tokens/s
    force: bool = False  # train even when the plan says the run does not fit
    track_memory: bool = False  # log `peak_tracked_gb`: torch's MemTracker on each real step (the planner's tool)
    # memory stack (each a switch; none changes the numbers)
    recompute: bool = True  # full activation recompute per layer
    offload: bool = True  # CPU offload of each layer's saved input
    keep_selection: bool = True  # keep DSA top-k selections for the recompute (the indexer runs once)
    recompute_chunks: bool = False  # also recompute each MoE / MLP / indexer-KL chunk on its own (less memory)
    expert_bias_speed: float = 1e-3  # auxiliary-loss-free expert balancing per step (DeepSeek-V3); 0 = off
    moe_chunk_tokens: int = 16384
    indexer_query_block: int = 128
    attention_query_block: int = 128
    loss_chunk_tokens: int = 8192
    train_indexer: bool = False
    precision: str = "auto"  # "bf16" (autocast, fp32 master weights), "fp32", or "auto": bf16 on CUDA, fp32 on CPU
    # training data options
    rc_aug: float = 0.0  # probability of training on a window's reverse complement
    softmask_weight: float = 1.0  # loss weight of soft-masked (lowercase, repeat) bases; eval is always unweighted
    seq_warmup_steps: int = 0  # train on shorter crops first, doubling up to seq over this many steps
    seq_warmup_start: int = 1024  # tokens of the first crops of the warm-up
    # checkpoints and logging
    save_every: int = 100
    keep_checkpoints: int = 2
    resume: str = "auto"  # "auto" (newest checkpoint of this run, if any), "never", or a checkpoint folder
    log_every: int = 1
    wandb: str = "offline"  # "offline", "online" or "disabled"
    max_bad_steps: int = 5  # stop after this many non-finite steps in a row
    dry_run: bool = False
    # evaluation
    bucket: int = 32768  # tokens per position bucket
    eval_windows: int = 0  # held-out windows to score (0 = all)
    context_cut: bool = True  # also score the last bucket with only the preceding bucket as context
    heldout: str | None = None  # prepared folders to evaluate, comma separated (default: the run's data)
    # copy probe (`genomelm probe`)
    probe_length: int = 200  # bases per planted segment
    probe_distances: str = "1k,4k,16k,64k,256k,1M"  # distances from the first copy to the second (<= seq)
    probe_windows: int = 4  # held-out windows probed (0 = all)
    runs_dir: str = "runs"
    results_dir: str = "results"
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return parse_seq(self.seq)

    def total_steps(self, n_windows: int) -> int:
        """`steps` if set, else enough optimizer steps for `epochs` passes over `n_windows` training windows."""
        if self.steps > 0:
            return self.steps
        return max(1, math.ceil(self.epochs * n_windows / self.grad_accum))

    @property
    def data_blend(self) -> list[tuple[str, float]]:
        """The training folders with their normalised weights (one folder: weight 1)."""
        if not self.data:
            return [(str(Path("data/prepared") / f"{self.genome}-{seq_label(self.seq_len)}"), 1.0)]
        from genomelm.data.augment import parse_blend

        return parse_blend(self.data)

    @property
    def data_dir(self) -> Path:
        """The run's (first) prepared folder: its held-out split is what `genomelm eval` scores by default."""
        return Path(self.data_blend[0][0])

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run

    @property
    def results_path(self) -> Path:
        return Path(self.results_dir) / self.run

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
        """Read a YAML run config and apply `key=value` overrides (values parsed as YAML scalars)."""
        raw: dict[str, Any] = {}
        if path is not None:
            path = Path(path)
            if not path.exists():
                raise FileNotFoundError(f"no run config at {path}; the presets are in configs/train/")
            raw = yaml.safe_load(path.read_text()) or {}
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} is not key=value (for example steps=10)")
            key, value = item.split("=", 1)
            raw[key.strip()] = yaml.safe_load(value) if value else ""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in raw if k not in fields)
        if unknown:
            raise ValueError(f"unknown run setting(s) {unknown}; known: {sorted(k for k in fields if k != 'extra')}")
        for key, value in raw.items():
            raw[key] = _coerce(key, value, fields[key].default)
        config = cls(**raw)
        parse_seq(config.seq)
        from genomelm.train.precision import PRECISIONS

        if config.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {config.precision!r}")
        if config.steps < 0 or config.epochs <= 0 or config.grad_accum < 1:
            raise ValueError(f"steps={config.steps}, epochs={config.epochs}, grad_accum={config.grad_accum}: "
                             "give steps >= 1 (or 0 to size from epochs > 0) and grad_accum >= 1")  # fmt: skip
        if config.wandb not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb must be offline, online or disabled, not {config.wandb!r}")
        return config

    @classmethod
    def from_args(cls, items: list[str]) -> TrainConfig:
        """`[CONFIG.yaml] [key=value ...]` as typed after `genomelm train` / `genomelm eval`."""
        if items and "=" not in items[0]:
            return cls.load(items[0], items[1:])
        return cls.load(None, items)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.pop("extra")
        out["betas"] = list(self.betas)
        return out


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Give a YAML/command-line value the type of the setting's default (YAML reads `3e-3` as a string)."""
    try:
        if isinstance(default, bool):
            if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
                return value.lower() in ("true", "yes", "on", "1")
            if isinstance(value, bool):
                return value
            raise ValueError
        if isinstance(default, float):
            return float(value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if isinstance(default, tuple):
            return tuple(float(v) for v in value)
        return None if value is None else str(value)
    except (TypeError, ValueError):
        raise ValueError(f"setting {key}={value!r}: expected a value like {default!r}") from None

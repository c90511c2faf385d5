"""Run configuration shared by `genomelm train`, `genomelm eval`, `genomelm probe` and `genomelm plan`.

A run is a YAML file in `configs/train/` plus `key=value` overrides from the command line
(`genomelm train configs/train/hg38-512k.yaml steps=10 seq=1M`). The settings are grouped by the part of the
program that owns them, one small dataclass each, which checks its own values:

| group | owner | settings |
|---|---|---|
| (top level) | the run | run, genome, seq, data, model, allow_random_init, dry_run, runs_dir, results_dir, |
| | | region |
| `optim` | the optimizer and its step | steps, epochs, lr, schedule, clipping, accumulation, seed, |
| | | expert bias |
| `data_options` | the training feed | reverse-complement, soft-mask weight, length warm-up |
| `memory` | what a step keeps, and its precision | recompute, offload, kept selection, chunk recompute, |
| | | precision |
| `model_options` | the model (`genomelm.model.RunOptions`) | chunk sizes, block backends, indexer training |
| `parallel` | the mesh and its launcher | dp, cp, ep, layout, FSDP, capacity, launcher, Ray, |
| | | collective timeout |
| `checkpoint` | the checkpointer | save_every, keep_checkpoints, resume |
| `log` | metrics | log_every, wandb, track_memory |
| `eval`, `probe` | the evaluator and the copy probe | buckets, held-out sets, probe distances, |
| | | eval during training |
| `track`, `variants`, `embed` | the genomics read-outs | regions, context cut, VCF, reference, layer, |
| | | pooling |
| `plan` | the planner | GPUs, GPU kind, search, force, traced device, assumptions |

A YAML file gives the groups as sections (`optim: {lr: 1e-5}`); flat keys work too. Overrides are the
setting's own name (`lr=1e-5`: every name is unique across groups) or dotted (`optim.lr=1e-5`). Every run
writes under `runs/<run>/` (checkpoints, metrics) and `results/<run>/` (evaluation tables and figures).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from genomelm import resources
from genomelm.data.augment import parse_blend
from genomelm.data.errors import DataError
from genomelm.data.regions import parse_seq, seq_label
from genomelm.model.config import PRESET_DIR, RunOptions, is_preset
from genomelm.parallel.mesh import ParallelDims
from genomelm.run.precision import PRECISIONS, REDUCE_DTYPES
from genomelm.run.readout_config import EmbedConfig, EvalConfig, ProbeConfig, TrackConfig, VariantConfig
from genomelm.run.setting_checks import check_choice, require

CP_LAYOUTS = ("zigzag", "contiguous")
LAUNCHERS = ("local", "ray", "env")
EXPERT_PLACEMENTS = ("static", "balanced")
WANDB_MODES = ("offline", "online", "disabled")
GPU_KINDS = ("b200", "h200")
PLAN_DEVICES = ("auto", "cpu", "cuda")
PLAN_STAGES = ("train", "eval")
EXPORT_FINAL = ("auto", "true", "false")


OPTIMIZERS = {
    "adamw": "torch AdamW: fp32 master weights and fp32 moments (16 bytes a parameter with its gradient)",
    "adamw8bit": "torchao AdamW8bit: fp32 master weights, 8-bit block-quantised moments (~10 bytes)",
    "adamw_bf16": "torchao AdamW8bit on bf16 weights with stochastic rounding, no fp32 master (~6 bytes)",
}


@dataclass
class OptimConfig:
    """The optimizer (`OPTIMIZERS`), warmup then cosine, accumulation, clipping, expert balancing."""

    optimizer: str = "adamw"  # adamw | adamw8bit | adamw_bf16: the state each parameter keeps (OPTIMIZERS)
    steps: int = 0  # optimizer steps; 0: from `epochs`
    epochs: float = 1.0  # passes over the training windows when steps = 0
    lr: float = 1e-5  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 50  # linear warmup, then cosine
    weight_decay: float = 0.1  # AdamW, on matrices only (not on norms, biases, gates, decays)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW
    grad_clip: float | None = 1.0  # global L2 norm the gradients are clipped to; none: no clipping
    grad_accum: int = 1  # windows per optimizer step (per dp rank)
    seed: int = 1234  # data order, augmentation draws and initialisation
    expert_bias_speed: float = 1e-3  # auxiliary-loss-free expert balancing per step (DeepSeek-V3); 0 = off
    max_bad_steps: int = 5  # stop after this many non-finite steps in a row

    def validate(self) -> None:
        check_choice("optimizer", self.optimizer, tuple(OPTIMIZERS))
        require(self.steps >= 0, f"steps={self.steps}: give steps >= 1, or 0 to size the run from epochs")
        require(self.epochs > 0, f"epochs={self.epochs}: give a number of passes > 0")
        require(self.grad_accum >= 1, f"grad_accum={self.grad_accum}: give windows per step >= 1")
        require(
            self.lr >= 0 and self.warmup_steps >= 0,
            f"lr={self.lr}, warmup_steps={self.warmup_steps}: give lr >= 0 and warmup_steps >= 0",
        )
        require(0 <= self.min_lr_ratio <= 1, f"min_lr_ratio={self.min_lr_ratio}: give a ratio in [0, 1]")
        require(
            self.grad_clip is None or self.grad_clip > 0,
            f"grad_clip={self.grad_clip}: give a gradient norm > 0, or none for no clipping",
        )
        require(self.weight_decay >= 0, f"weight_decay={self.weight_decay}: give a decay >= 0")
        require(all(0 <= b < 1 for b in self.betas), f"betas={self.betas}: give two values in [0, 1)")
        require(self.max_bad_steps >= 1, f"max_bad_steps={self.max_bad_steps}: give a number of steps >= 1")


@dataclass
class DataOptions:
    """How training windows are drawn (each choice a function of seed, step and micro-batch)."""

    rc_aug: float = 0.0  # probability of training on a window's reverse complement
    softmask_weight: float = 1.0  # loss weight of soft-masked (lowercase, repeat) bases; eval is unweighted
    seq_warmup_steps: int = 0  # train on shorter crops first, doubling up to seq over this many steps
    seq_warmup_start: int = 1024  # tokens of the first crops of the warm-up

    def validate(self) -> None:
        require(0 <= self.rc_aug <= 1, f"rc_aug={self.rc_aug}: give a probability in [0, 1]")
        require(self.softmask_weight >= 0, f"softmask_weight={self.softmask_weight}: give a loss weight >= 0")
        require(self.seq_warmup_steps >= 0, f"seq_warmup_steps={self.seq_warmup_steps}: give steps >= 0")
        require(self.seq_warmup_start >= 1, f"seq_warmup_start={self.seq_warmup_start}: give tokens >= 1")


@dataclass
class MemoryConfig:
    """What a step keeps between its forward and backward, and the precision it computes in. No switch changes
    the numbers (tested); each trades memory for time."""

    recompute: bool = True  # full activation recompute per layer
    offload: bool = True  # CPU offload of each layer's saved input
    keep_selection: bool = True  # keep DSA top-k selections for the recompute (the indexer runs once)
    recompute_chunks: bool = (
        False  # also recompute each MoE / MLP / indexer-KL chunk on its own (less memory)
    )
    precision: str = (
        "auto"  # "bf16" (autocast, fp32 master weights), "fp32", or "auto": bf16 on CUDA, else fp32
    )

    def validate(self) -> None:
        check_choice("precision", self.precision, PRECISIONS)


@dataclass
class ParallelConfig:
    """The dp x cp mesh (ep borrowing its ranks), its sharding, and the launcher that starts its processes."""

    dp: int = 1  # data parallel: each of dp replicas reads its own windows (processes: dp * cp)
    cp: int = 1  # context parallel: ranks one window is split over
    ep: int = 1  # expert parallel: the routed experts split over ep of the dp * cp ranks (ep divides dp * cp)
    cp_layout: str = "zigzag"  # "zigzag" (balanced indexer work) or "contiguous"
    fsdp: bool = True  # with more than one process: FSDP2 shards parameters, gradients and optimizer state
    optimizer_offload: bool = False  # weights, gradients and optimizer state in host memory (FSDP2, GPUs)
    # FSDP2: layers whose all-gathers each layer issues ahead of its own work, in the forward (before its MoE
    # host sync) and the backward; each costs one more layer's gathered parameters. 0: FSDP2's default
    fsdp_prefetch: int = 0
    # FSDP2: the dtype gradients are reduce-scattered in, "fp32" or "bf16" (half the bytes; each rank's
    # shard, the accumulation over micro-batches and the optimizer stay fp32)
    reduce_dtype: str = "fp32"
    ep_capacity_factor: float = 8.0  # refuse an MoE exchange giving a rank more than this x the mean tokens
    # start each expert exchange ahead of the work that needs it (the next chunk's dispatch during this
    # chunk's expert GEMMs, the combine during the shared expert); false: every exchange blocks (same results)
    ep_overlap: bool = True
    # "static": rank r holds the block of experts [r E/ep, (r+1) E/ep); "balanced": each MoE layer's experts
    # placed at each resume to even the ranks' rows by the run's routed load so far
    # (runs/<run>/expert_placement.json; a fresh run starts on the static blocks)
    expert_placement: str = "static"
    # with expert_placement=balanced: slots per rank for copies of the hottest experts (their weights fetched
    # from the owner each layer pass, their gradients summed into the owner's), used where they lower the
    # busiest rank's rows
    expert_copies: int = 0
    # "local" (processes on this machine), "ray" (Ray Train workers) or "env" (torchrun or srun started
    # this process as one rank: `genomelm.run.env_launch`)
    launcher: str = "local"
    ray_address: str | None = None  # an existing Ray cluster ("auto", "ray://host:10001"); none: a local Ray
    max_failures: int = 0  # worker failures Ray restarts the group after (from the last checkpoint)
    collective_timeout_s: float = 600.0  # a collective waiting this long fails its rank (stuck/dead peer)

    @property
    def world(self) -> int:
        return self.dp * self.cp

    def validate(self) -> None:
        ParallelDims(self.dp, self.cp, self.ep).check()  # the model's expert count is checked at launch
        check_choice("cp_layout", self.cp_layout, CP_LAYOUTS)
        check_choice("launcher", self.launcher, LAUNCHERS)
        check_choice("expert_placement", self.expert_placement, EXPERT_PLACEMENTS)
        check_choice("reduce_dtype", self.reduce_dtype, REDUCE_DTYPES)
        require(
            self.fsdp_prefetch >= 0, f"fsdp_prefetch={self.fsdp_prefetch}: give layers gathered ahead (>= 0)"
        )
        require(
            self.reduce_dtype == "fp32" or self.fsdp,
            f"reduce_dtype={self.reduce_dtype} is FSDP2's reduce-scatter: it needs fsdp=true",
        )
        require(
            self.expert_copies == 0 or (0 < self.expert_copies and self.expert_placement == "balanced"),
            f"expert_copies={self.expert_copies}: give 0, or copy slots per rank (> 0) with "
            "expert_placement=balanced",
        )
        require(
            self.ep_capacity_factor > 1,
            f"ep_capacity_factor={self.ep_capacity_factor}: give a multiple of the mean (> 1)",
        )
        require(
            not self.optimizer_offload or (self.fsdp and self.world > 1),
            "optimizer_offload=true is FSDP2's CPU offload: it needs fsdp=true and dp*cp > 1",
        )
        require(
            self.max_failures >= 0, f"max_failures={self.max_failures}: give the number of restarts (>= 0)"
        )
        require(
            self.max_failures == 0 or self.launcher == "ray",
            f"max_failures={self.max_failures}: restarts are Ray's (launcher=ray)",
        )
        require(
            self.collective_timeout_s > 0,
            f"collective_timeout_s={self.collective_timeout_s}: give the seconds a collective may wait (> 0)",
        )


@dataclass
class CheckpointConfig:
    """When the checkpointer writes, how many it keeps, and where a run continues from."""

    save_every: int = 100  # optimizer steps between checkpoints (and at the last step)
    keep_checkpoints: int = 2  # newest complete checkpoints kept (0: all)
    resume: str = "auto"  # "auto" (newest checkpoint of this run, if any), "never", or a checkpoint folder
    # the Hugging Face copy of a sharded run's last checkpoint (`genomelm eval` reads the sharded one
    # directly): "true", "false", or "auto" (written unless the run spans more than one node)
    export_final: str = "auto"

    def validate(self) -> None:
        self.export_final = str(self.export_final).lower()  # YAML reads `true` as a bool
        check_choice("export_final", self.export_final, EXPORT_FINAL)
        require(self.save_every >= 1, f"save_every={self.save_every}: give a number of steps >= 1")
        require(
            self.keep_checkpoints >= 0, f"keep_checkpoints={self.keep_checkpoints}: give >= 0 (0 keeps all)"
        )
        require(bool(self.resume), "resume is empty: give auto, never or a checkpoint folder")


@dataclass
class LogConfig:
    """Metrics: `runs/<run>/metrics.jsonl`, the progress bar and Weights & Biases."""

    log_every: int = 1  # optimizer steps between metrics rows
    wandb: str = "offline"  # "offline", "online" or "disabled"
    # W&B project, entity (team or user) and group; none: $WANDB_PROJECT (else "genomelm"), $WANDB_ENTITY
    # (else the account's default) and $WANDB_RUN_GROUP
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_group: str | None = None
    track_memory: bool = (
        False  # log `peak_tracked_gb`: torch's MemTracker on each real step (the planner's tool)
    )

    def validate(self) -> None:
        check_choice("wandb", self.wandb, WANDB_MODES)
        require(self.log_every >= 1, f"log_every={self.log_every}: give a number of steps >= 1")


@dataclass
class PlanConfig:
    """`genomelm plan` and the plan a GPU run is checked against before it starts."""

    gpus: int = 0  # GPUs to plan for (0: dp * cp of the run)
    gpu: str = "b200"  # "b200" (178 GiB usable) or "h200" (139 GiB)
    gpu_gib: float = 0.0  # device memory a rank may use, GiB (0: the GPU's usable memory; e.g. a budget)
    search: bool = False  # plan every layout that fits and rank them by projected tokens/s
    force: bool = False  # train even when the plan says the run does not fit
    # what the projection assumes
    mfu: float = 0.35  # achieved fraction of the GPU's dense bf16 peak
    tflops: float = 0.0  # the GPU's dense bf16 datasheet peak, TFLOP/s, MFU's denominator (0: from `gpu`)
    # the links, GB/s per direction (0: the attainable rates of `gpu`, genomelm/plan/rates.py)
    nvlink_gbs: float = 0.0  # a GPU's NVLink inside a node
    nic_gbs: float = 0.0  # one NIC between nodes
    nics_per_node: int = 8  # NICs of a node, used together by a ring across nodes
    pcie_gbs: float = 0.0  # a GPU's PCIe to host memory (offload copies)
    gpus_per_node: int = 8  # GPUs sharing a node (NVLink inside, the NICs between)
    host_gib: float = (
        2048.0  # host memory per node (DGX B200 / H200: 2 TiB); a layout needing more does not fit
    )
    imbalance: float = 0.0  # busiest EP rank's rows over the mean; 0: measured (expert_load, metrics), else 4
    trace_tokens: int = 2048  # most tokens per rank traced; more are extrapolated
    # "cuda" (and auto): also simulate the run's own step on fake CUDA tensors (collectives checked as NCCL
    # would, host syncs counted); "cpu": the memory trace (fake CPU tensors) only
    device: str = "auto"
    stage: str = "train"  # what is planned: "train" (the training step) or "eval" (the evaluator's forward)

    def validate(self) -> None:
        check_choice("gpu", self.gpu, GPU_KINDS)
        check_choice("stage", self.stage, PLAN_STAGES)
        check_choice("device", self.device, PLAN_DEVICES)
        require(
            self.gpus >= 0, f"gpus={self.gpus}: give the number of GPUs to plan for (0: the run's dp * cp)"
        )
        require(0 < self.mfu <= 1, f"mfu={self.mfu}: give a fraction of peak in (0, 1]")
        require(self.gpu_gib >= 0, f"gpu_gib={self.gpu_gib}: give GiB per GPU (0: the GPU's usable memory)")
        require(self.imbalance >= 0, f"imbalance={self.imbalance}: give >= 0 (0: measured from the run)")
        require(
            self.trace_tokens >= 1 and self.gpus_per_node >= 1 and self.nics_per_node >= 1,
            f"trace_tokens={self.trace_tokens}, gpus_per_node={self.gpus_per_node}, "
            f"nics_per_node={self.nics_per_node}: give each >= 1",
        )
        links = {"nvlink_gbs": self.nvlink_gbs, "nic_gbs": self.nic_gbs, "pcie_gbs": self.pcie_gbs}
        for name, value in links.items():
            require(value >= 0, f"{name}={value}: give GB/s per direction (0: the GPU's attainable rate)")


@dataclass
class TrainConfig:
    """Everything a training or evaluation run needs: the run's identity at the top level, the rest in groups
    (see the module docstring). Token counts are per window (one micro-batch row)."""

    run: str = "run"  # name: runs/<run>/ and results/<run>/
    genome: str = "hg38"  # prepared data lives in data/prepared/<genome>-<seq>/ unless `data` is set
    seq: str = "512k"  # tokens per window: 16k, 512k, 1M (= 1,048,576) or any integer
    data: str | None = None  # prepared-data folder, or a weighted blend of several: dirA:0.7,dirB:0.3
    model: str | None = "glm-5.3-flash"  # checkpoint folder or preset name (the hg38 configs need a folder)
    allow_random_init: bool = False  # allow a preset of over 1B parameters (random weights: benchmarks only)
    dry_run: bool = False  # print the model's layer routes and memory switches, train nothing
    runs_dir: str = "runs"  # where runs/<run>/ (checkpoints, metrics) lives
    results_dir: str = "results"  # where results/<run>/ (evaluation tables, figures) lives
    # what `genomelm track` and `genomelm embed` read: "chr:start-end" (1-based, inclusive) or a BED file of
    # the run's source reference; default: the held-out windows
    region: str | None = None
    optim: OptimConfig = field(default_factory=OptimConfig)
    data_options: DataOptions = field(default_factory=DataOptions)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    model_options: RunOptions = field(default_factory=RunOptions)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    track: TrackConfig = field(default_factory=TrackConfig)
    variants: VariantConfig = field(default_factory=VariantConfig)
    embed: EmbedConfig = field(default_factory=EmbedConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)

    GROUPS: ClassVar[tuple[str, ...]] = (
        "optim",
        "data_options",
        "memory",
        "model_options",
        "parallel",
        "checkpoint",
        "log",
        "eval",
        "probe",
        "track",
        "variants",
        "embed",
        "plan",
    )

    @property
    def seq_len(self) -> int:
        return parse_seq(self.seq)

    def total_steps(self, n_windows: int) -> int:
        """`steps` if set, else enough optimizer steps for `epochs` passes over `n_windows` training
        windows."""
        if self.optim.steps > 0:
            return self.optim.steps
        return max(1, math.ceil(self.optim.epochs * n_windows / self.optim.grad_accum))

    @property
    def data_blend(self) -> list[tuple[str, float]]:
        """The training folders with their normalised weights (one folder: weight 1)."""
        if not self.data:
            return [(str(Path("data/prepared") / f"{self.genome}-{seq_label(self.seq_len)}"), 1.0)]

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

    def validate(self) -> TrainConfig:
        """Check every group's values (ValueError naming the setting); returns self."""
        try:
            parse_seq(self.seq)
        except DataError:
            raise ValueError(
                f"seq={self.seq!r}: give a positive token count such as 16k, 512k, 1M or 4096"
            ) from None
        if self.model and not is_preset(self.model) and not Path(self.model).exists():
            presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
            raise ValueError(
                f"model={self.model}: no such checkpoint folder or preset; give a folder holding config.json "
                f"(make train MODEL=/path/to/GLM-5.3-Flash) or a preset ({presets})"
            )
        if not self.run or "/" in self.run or self.run in (".", ".."):
            raise ValueError(f"run={self.run!r}: give a folder name (runs/<run>/), without '/'")
        for group in self.GROUPS:
            check = getattr(getattr(self, group), "validate", None)
            if check is not None:
                check()
        if self.optim.optimizer == "adamw_bf16" and self.memory.precision != "bf16":
            raise ValueError(
                f"optimizer=adamw_bf16 with precision={self.memory.precision}: it keeps the weights in bf16, "
                "which the model reads under bf16 autocast; add precision=bf16"
            )
        if self.parallel.max_failures > 0 and self.checkpoint.resume != "auto":
            raise ValueError(
                f"max_failures={self.parallel.max_failures} with resume={self.checkpoint.resume!r}: a "
                "restarted group continues from the run's newest checkpoint, which is resume=auto"
            )
        return self

    def replace(self, **settings: Any) -> TrainConfig:
        """A copy with settings changed by name (`steps=3`, `cp=2`: each name finds its group)."""
        top = {k: v for k, v in settings.items() if k in _TOP_LEVEL}
        groups: dict[str, dict[str, Any]] = {}
        for key, value in settings.items():
            if key in top:
                continue
            if key not in _SETTING_GROUP:
                raise ValueError(f"unknown run setting {key!r}")
            groups.setdefault(_SETTING_GROUP[key], {})[key] = value
        parts = {
            group: dataclasses.replace(getattr(self, group), **values) for group, values in groups.items()
        }
        return dataclasses.replace(self, **top, **parts)

    @classmethod
    def load(cls, paths: str | Path | list[str | Path] | None, overrides: list[str] = ()) -> TrainConfig:
        """Read YAML run configs (sections or flat keys; a later file overrides an earlier one) and apply
        `key=value` overrides (values parsed as YAML scalars; keys flat or dotted)."""
        if paths is None:
            paths = []
        elif isinstance(paths, (str, Path)):
            paths = [paths]
        settings: dict[str, Any] = {}
        for path in map(Path, paths):
            settings.update(_shipped_model(_read_yaml(path, cls.GROUPS), path))
        return cls._from_flat(settings, overrides)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "settings", check: bool = True) -> TrainConfig:
        """The settings of a mapping shaped as `to_dict` gives them (sections or flat keys), e.g. the one a
        checkpoint's trainer state keeps; `source` names it in errors. `check=False`: types only, not
        `validate` (a record read elsewhere, whose model folder need not exist here)."""
        return cls._from_flat(_flat_settings(raw, cls.GROUPS, source), [], check)

    @classmethod
    def _from_flat(cls, settings: dict[str, Any], overrides: list[str], check: bool = True) -> TrainConfig:
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} is not key=value (for example steps=10)")
            key, value = item.split("=", 1)
            settings[_flat_key(key.strip(), None)] = _yaml_value(item, value) if value else ""
        coerced = {key: _coerce(key, value, _DEFAULTS[key]) for key, value in settings.items()}
        config = cls().replace(**coerced)
        return config.validate() if check else config

    @classmethod
    def from_args(cls, items: list[str]) -> TrainConfig:
        """`[CONFIG.yaml ...] [key=value ...]` as typed after `genomelm train` / `genomelm eval`."""
        paths = [item for item in items if "=" not in item]
        return cls.load(paths, [item for item in items if "=" in item])

    def to_dict(self) -> dict[str, Any]:
        """The settings as the YAML sections would give them."""
        out = dataclasses.asdict(self)
        out["optim"]["betas"] = list(self.optim.betas)
        return out


def _group_fields() -> dict[str, tuple[str, Any]]:
    """Every grouped setting's name -> (group, default)."""
    out: dict[str, tuple[str, Any]] = {}
    defaults = TrainConfig()
    for group in TrainConfig.GROUPS:
        for f in dataclasses.fields(getattr(defaults, group)):
            out[f.name] = (group, getattr(getattr(defaults, group), f.name))
    return out


_TOP_LEVEL = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name not in TrainConfig.GROUPS}
_SETTING_GROUP = {name: group for name, (group, _) in _group_fields().items()}
_DEFAULTS = _TOP_LEVEL | {name: default for name, (_, default) in _group_fields().items()}
_OPTIONAL = {  # settings that take null / none
    f.name
    for owner in (TrainConfig(), *(getattr(TrainConfig(), group) for group in TrainConfig.GROUPS))
    for f in dataclasses.fields(owner)
    if "None" in str(f.type)
}


def _yaml_value(item: str, value: str) -> Any:
    """An override's value as a YAML scalar (or list); a ValueError naming the override if it is not YAML."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"override {item!r}: its value is not valid YAML ({problem})") from None


def _read_yaml(path: Path, groups: tuple[str, ...]) -> dict[str, Any]:
    """A run config file's settings by flat name; a relative path missing from the working directory is
    looked up among the shipped configs (`configs/train/demo.yaml` after a wheel install)."""
    path = resources.shipped(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no run config at {path}; the presets are in configs/train/ (clusters: configs/cluster/)"
        )
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and start is not None and start.line != getattr(mark, "line", None):
            problem += f", {context} at line {start.line + 1}"
        raise ValueError(f"{where}: not valid YAML ({problem}); fix the file there") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a run config is a mapping of settings (key: value)")
    return _flat_settings(raw, groups, path)


def _shipped_model(settings: dict[str, Any], path: Path) -> dict[str, Any]:
    """`settings` of the run config `path` with a relative `model` folder that is not in the working directory
    but ships with genomelm (`data/models/demo-fly4` of configs/train/demo.yaml) made absolute."""
    model = settings.get("model")
    if not isinstance(model, str) or is_preset(model) or Path(model).exists():
        return settings
    if not resources.is_shipped(path):
        return settings
    found = resources.shipped(model)
    return settings | {"model": str(found)} if found.exists() else settings


def _flat_settings(raw: dict[str, Any], groups: tuple[str, ...], source: Path | str) -> dict[str, Any]:
    """A mapping of settings (sections or flat keys) by flat name; errors name `source`."""
    settings: dict[str, Any] = {}
    for key, value in raw.items():
        if key in groups:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: section {key!r} must be a mapping of its settings")
            settings.update({_flat_key(f"{key}.{k}", source): v for k, v in value.items()})
        else:
            settings[_flat_key(key, source)] = value
    return settings


def setting_names() -> dict[str, str]:
    """Every setting's flat name -> its group ("" for the top level), in declaration order."""
    return {name: "" for name in _TOP_LEVEL} | dict(_SETTING_GROUP)


def _flat_key(key: str, source: Path | str | None) -> str:
    """A setting's flat name from `name` or `group.name`; an error names the known settings."""
    group, _, name = key.rpartition(".")
    if (not group and name in _DEFAULTS) or (group and _SETTING_GROUP.get(name) == group):
        return name
    where = f"{source}: " if source is not None else ""
    raise ValueError(
        f"{where}unknown run setting {key!r}; known: {sorted(_DEFAULTS)} (flat, or dotted as group.name; "
        "docs/settings.md lists them)"
    )


def _coerce(key: str, value: Any, default: Any) -> Any:
    """Give a YAML/command-line value the type of the setting's default (YAML reads `3e-3` as a string):
    numbers finite and of their kind (`inf`, `nan` and `true` refused for a number), a pair a pair."""
    if value is None or (isinstance(value, str) and value.lower() in ("null", "none")):
        if key in _OPTIONAL:
            return None
        raise ValueError(f"setting {key}={value!r}: expected a value like {default!r}")
    try:
        if isinstance(default, bool):
            return _as_bool(value)
        if isinstance(default, (int, float)):
            return _as_number(value, float if isinstance(default, float) else int)
        if isinstance(default, tuple):
            if not isinstance(value, (list, tuple)) or len(value) != len(default):
                raise ValueError
            return tuple(_as_number(v, float) for v in value)
        return str(value)
    except (TypeError, ValueError, OverflowError):
        kind = {bool: "true or false", int: "a whole number", float: "a finite number"}.get(type(default))
        if isinstance(default, tuple):
            kind = f"a list of {len(default)} finite numbers"
        expected = f"{kind}, e.g. {_yaml_text(default)}" if kind else f"a value like {default!r}"
        raise ValueError(f"setting {key}={_yaml_text(value)}: expected {expected}") from None


BOOL_WORDS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in BOOL_WORDS:
        return BOOL_WORDS[value.lower()]
    raise ValueError


def _as_number(value: Any, kind: type) -> int | float:
    """`value` as a finite `kind` (int: a whole number, also written 2.0 or "2"); no bools, no inf or nan."""
    if isinstance(value, bool):
        raise ValueError
    if kind is int and isinstance(value, int):
        return value
    number = float(value)
    if not math.isfinite(number) or (kind is int and not number.is_integer()):
        raise ValueError
    return int(number) if kind is int else number


def _yaml_text(value: Any) -> str:
    """A setting's value as the user would write it (lists and tuples in brackets)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_yaml_text, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)

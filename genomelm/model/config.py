"""Typed configuration of GLM-5.3-Flash (`model_type: glm5_next`) and of how genomelm runs it.

`ModelConfig` holds the architecture with the field names of Hugging Face's `Glm5NextTextConfig`, so a
`config.json` maps onto it one to one. `RunOptions` holds execution settings (chunk sizes, the dense
guard) that change memory and time but never the numbers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from genomelm import resources

KDA = "linear_attention"
DSA = "indexed_attention"
DENSE = "dense"
MOE = "sparse"

# the repository's configs/model, or the copy a wheel installed (`genomelm.resources`)
PRESET_DIR = resources.root() / "configs" / "model"


def is_preset(model: str | None) -> bool:
    """Whether `model` names a preset of `PRESET_DIR` (`tiny`, `demo`, ...) rather than an existing folder."""
    return bool(model) and not Path(model).exists() and (PRESET_DIR / f"{model}.yaml").exists()


class ConfigError(ValueError):
    """An inconsistent or unreadable model configuration."""


@dataclass
class ModelConfig:
    """GLM-5.3-Flash text architecture. Defaults are the official checkpoint's (`zai-org/GLM-5.3-Flash`)."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    # MLA (DSA layers), NoPE
    num_attention_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    # k-pool lightning indexer
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 4
    index_kpool_always_select_tail: bool = True
    # KDA (linear attention layers)
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    # feed-forward
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    # mHC residual
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # misc
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 154820
    # per-layer schedules; None means the checkpoint's pattern (see `__post_init__`)
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    # fields of the source config.json that genomelm does not use (MTP, vision...), kept for saving
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [DSA if i % 4 == 3 else KDA for i in range(n)]
        self.layer_types = [DSA if t == "full_attention" else t for t in self.layer_types]
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [DENSE] * min(3, n) + [MOE] * max(n - 3, 0)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * n
        self.validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        n = self.num_hidden_layers
        problems: list[str] = []
        for name in ("layer_types", "mlp_layer_types", "indexer_types"):
            values = getattr(self, name)
            if len(values) != n:
                problems.append(f"{name} has {len(values)} entries but num_hidden_layers is {n}")
        bad = sorted({t for t in self.layer_types if t not in (KDA, DSA)})
        if bad:
            problems.append(f"layer_types may hold {KDA!r} or {DSA!r}, not {bad}")
        bad = sorted({t for t in self.mlp_layer_types if t not in (DENSE, MOE)})
        if bad:
            problems.append(f"mlp_layer_types may hold {DENSE!r} or {MOE!r}, not {bad}")
        bad = sorted({t for t in self.indexer_types if t not in ("full", "shared")})
        if bad:
            problems.append(f"indexer_types may hold 'full' or 'shared', not {bad}")
        dsa_layers = [i for i, t in enumerate(self.layer_types) if t == DSA]
        if dsa_layers and self.indexer_types[dsa_layers[0]] == "shared":
            problems.append(
                f"layer {dsa_layers[0]} is the first DSA layer and cannot share ('shared') an earlier indexer"
            )
        if self.qk_rope_head_dim != 0:
            problems.append(
                f"GLM-5.3-Flash attention is NoPE: qk_rope_head_dim must be 0, got {self.qk_rope_head_dim}"
            )
        if self.index_kpool < 1 or self.index_topk % self.index_kpool:
            problems.append(
                f"index_topk ({self.index_topk}) must be a multiple of index_kpool ({self.index_kpool})"
            )
        if self.n_routed_experts % self.n_group:
            problems.append(
                f"n_routed_experts ({self.n_routed_experts}) must divide into n_group ({self.n_group})"
            )
        if not 1 <= self.topk_group <= self.n_group:
            problems.append(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        if MOE in self.mlp_layer_types and self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            problems.append("group-limited routing needs at least 2 experts per group")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            problems.append(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..n_routed_experts "
                f"({self.n_routed_experts})"
            )
        if self.hidden_act != "silu":
            problems.append(f"only hidden_act 'silu' is supported, got {self.hidden_act!r}")
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            problems.append("hc_mult and hc_sinkhorn_iters must be positive")
        if problems:
            raise ConfigError("inconsistent GLM-5.3-Flash config:\n  - " + "\n  - ".join(problems))

    # --------------------------------------------------------------- summaries
    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == DSA]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # -------------------------------------------------------------- conversion
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config dict: `glm5_next` (nested `text_config`), `glm5_next_text`, or
        flat."""
        raw = dict(raw)
        outer_extra: dict[str, Any] = {}
        model_type = raw.get("model_type")
        if model_type == "glm5_next" and isinstance(raw.get("text_config"), dict):
            outer_extra = {k: v for k, v in raw.items() if k != "text_config"}
            raw = dict(raw["text_config"])
        elif model_type not in (None, "glm5_next", "glm5_next_text"):
            raise ConfigError(f"expected model_type 'glm5_next' or 'glm5_next_text', got {model_type!r}")
        linear = raw.pop("linear_attn_config", None)
        if isinstance(linear, dict):  # the checkpoint's nested spelling of the KDA fields
            raw.setdefault("linear_head_dim", linear.get("head_dim", cls.linear_head_dim))
            raw.setdefault("linear_num_heads", linear.get("num_heads", cls.linear_num_heads))
            raw.setdefault(
                "linear_conv_kernel_dim", linear.get("short_conv_kernel_size", cls.linear_conv_kernel_dim)
            )
            raw.setdefault("linear_lower_bound", linear.get("gate_lower_bound", cls.linear_lower_bound))
        if raw.get("indexer_types") is None and raw.get("index_topk_pattern") is not None:
            pattern = raw["index_topk_pattern"]
            raw["indexer_types"] = (
                [{"F": "full", "S": "shared"}[c] for c in pattern]
                if isinstance(pattern, str)
                else list(pattern)
            )
        if "num_key_value_heads" in raw and raw["num_key_value_heads"] not in (
            None,
            raw.get("num_attention_heads", 64),
        ):
            raise ConfigError("GLM-5.3-Flash MLA needs num_key_value_heads == num_attention_heads")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in raw.items() if k in known}
        extra = {k: v for k, v in raw.items() if k not in known}
        if outer_extra:
            extra["_outer"] = outer_extra
        try:
            return cls(**kwargs, extra=extra)
        except TypeError as exc:  # wrong value types
            raise ConfigError(f"unreadable GLM-5.3-Flash config: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read a `config.json` (or a folder holding one) or a preset YAML."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            presets = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml")))
            raise ConfigError(
                f"no model config at {path}: give a checkpoint folder holding config.json, or a preset "
                f"({presets})"
            )
        text = path.read_text()
        raw = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else json.loads(text)
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} does not hold a config mapping")
        return cls.from_dict(raw)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """One of `configs/model/*.yaml`: `glm-5.3-flash`, `small`, `tiny`, ..."""
        path = PRESET_DIR / f"{name}.yaml"
        if not path.exists():
            names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
            raise ConfigError(f"unknown model preset {name!r}; presets in {PRESET_DIR}: {names}")
        return cls.from_file(path)

    def text_config_dict(self) -> dict[str, Any]:
        """The fields transformers' `Glm5NextTextConfig` reads (model_type `glm5_next_text`)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["num_key_value_heads"] = self.num_attention_heads
        out["model_type"] = "glm5_next_text"
        out.update({k: v for k, v in self.extra.items() if k != "_outer"})
        return out


@dataclass
class RunOptions:
    """How the model runs: settings that trade memory for time and never change the numbers.

    Token counts are per micro-batch row (one window).
    """

    kda_chunk_size: int = 64  # delta-rule chunk (tokens)
    kda_backend: str = "auto"  # "auto" (fla-core chunk_kda on CUDA when installed), "torch", "recurrent"
    kda_gate_in_kernel: bool = False  # fla computes KDA's bounded gate inside chunk_kda (checked on a GPU)
    dsa_backend: str = "auto"  # "auto" (triton on CUDA, else sparse), "triton", "sparse" (gather), "dense"
    indexer_backend: str = "auto"  # "auto" (Triton kernel on CUDA, else torch), "triton", "torch"
    indexer_precision: str = "bf16"  # "bf16" or "fp8" (e4m3 scores, per-row scales; Hopper and newer)
    mhc_backend: str = "auto"  # "auto" (Triton kernels on CUDA, else torch), "triton", "torch"
    moe_backend: str = "grouped"  # "grouped" (tokens sorted by expert) or "loop" (readable reference)
    # the routed experts' grouped GEMMs: "bf16", "fp8_rowwise" (Hopper+) or "mxfp8" (Blackwell), quantised
    # as torchao's MoE training does (emulated off CUDA); the weights stay as stored (expert_precision.py)
    expert_precision: str = "bf16"
    indexer_query_block: int = 128  # queries scored against all pools at once
    attention_query_block: int = 128  # queries attending over their gathered tokens at once
    moe_chunk_tokens: int = 4096  # tokens routed + computed through the experts at once
    loss_chunk_tokens: int = 4096  # tokens whose logits exist at once in the cross-entropy
    forbid_dense_above: int | None = 8192  # refuse any S x S tensor for sequences longer than this
    train_indexer: bool = False  # add the indexer's KL training signal (DeepSeek-V3.2)

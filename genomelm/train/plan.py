"""`dry_run=true`: resolve a run without a GPU and without weights, and say what it would hold in memory.

The model is built on the meta device (the full GLM-5.3-Flash has ~321B parameters), so the parameter
count is exact; tensor sizes come from the config and the chunk settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.train.checkpoints import is_preset
from genomelm.train.config import TrainConfig
from genomelm.train.memory import LayerRunner

GB = 1e9


@dataclass
class TensorEstimate:
    name: str
    shape: str
    bytes: float
    where: str


def resolve_model_config(config: TrainConfig) -> ModelConfig:
    """The run's architecture; without a model set, the GLM-5.3-Flash architecture the hg38 configs train."""
    if not config.model:
        return ModelConfig.preset("glm-5.3-flash")
    if is_preset(config.model):
        return ModelConfig.preset(config.model)
    if not Path(config.model).exists():
        raise FileNotFoundError(f"model {config.model!r} is neither a preset in configs/model/ nor a folder")
    return ModelConfig.from_file(config.model)


def largest_tensors(model: ModelConfig, options: RunOptions, seq: int, act_bytes: int,
                    n_params: int) -> list[TensorEstimate]:
    """Sizes of the tensors that dominate memory for one window of `seq` tokens (batch 1)."""
    s, d, hc = seq, model.hidden_size, model.hc_mult
    out = [
        TensorEstimate("weights, fp32 master", f"{n_params / 1e9:.1f}B params", 4 * n_params, "device (sharded)"),
        TensorEstimate("gradients, fp32", f"{n_params / 1e9:.1f}B params", 4 * n_params, "device (sharded)"),
        TensorEstimate("AdamW moments (2 x fp32)", f"{n_params / 1e9:.1f}B params", 8 * n_params, "device (sharded)"),
        TensorEstimate("one layer's saved input (mHC streams)", f"[{s}, {hc}, {d}] bf16", s * hc * d * act_bytes,
                       "host if offload, else device; one per layer"),
        TensorEstimate("all layers' saved inputs", f"{model.num_hidden_layers} x [{s}, {hc}, {d}] bf16",
                       model.num_hidden_layers * s * hc * d * act_bytes, "host if offload, else device"),
    ]
    if model.kda_layers:
        h, dk = model.linear_num_heads, model.linear_head_dim
        chunks = -(-s // options.kda_chunk_size)
        out += [
            TensorEstimate("KDA q, k, v, decay", f"4 x [{s}, {h}, {dk}]", 4 * s * h * dk * act_bytes, "device, per layer"),
            TensorEstimate("KDA chunk states (kept for backward)", f"[{chunks}, {h}, {dk}, {dk}] fp32",
                           chunks * h * dk * dk * 4, "device, per layer"),
        ]
    if model.dsa_layers:
        pools = -(-s // model.index_kpool)
        slots = model.index_topk + (model.index_kpool - 1 if model.index_kpool_always_select_tail else 0)
        qb, ab = options.indexer_query_block, options.attention_query_block
        out += [
            TensorEstimate("indexer scores, one query block", f"[{qb}, {model.index_n_heads}, {pools}] fp32",
                           qb * model.index_n_heads * pools * 4, "device, transient"),
            TensorEstimate("selected pools, one layer", f"[{s}, {model.index_topk // model.index_kpool}] int32",
                           s * model.index_topk // model.index_kpool * 4,
                           "device; one per DSA layer until the backward with keep_selection"),
            TensorEstimate("gathered latents, one query block", f"[{ab}, {slots}, {model.kv_lora_rank}]",
                           ab * slots * model.kv_lora_rank * act_bytes, "device, transient"),
            TensorEstimate("attention scores, one query block", f"[{ab}, {model.num_attention_heads}, {slots}] fp32",
                           ab * model.num_attention_heads * slots * 4, "device, transient"),
        ]
    if "sparse" in model.mlp_layer_types:
        c, k, width = options.moe_chunk_tokens, model.num_experts_per_tok, model.moe_intermediate_size
        out.append(TensorEstimate("MoE expert activations, one chunk", f"[{c} x {k}, 3 x {width}]",
                                  c * k * 3 * width * act_bytes, "device, transient"))
    if "dense" in model.mlp_layer_types:
        c, width = options.moe_chunk_tokens, model.intermediate_size
        out.append(TensorEstimate("dense MLP activations, one chunk", f"[{c}, 3 x {width}]", c * 3 * width * act_bytes,
                                  "device, transient"))
    out.append(TensorEstimate("logits, one loss chunk", f"[{options.loss_chunk_tokens}, {model.vocab_size}] fp32",
                              options.loss_chunk_tokens * model.vocab_size * 4, "device, transient"))
    return out


def describe_run(config: TrainConfig) -> str:
    """The dry-run report: model, layer paths, memory switches, largest tensors."""
    from genomelm.train.loop import run_options

    model_config = resolve_model_config(config)
    options = run_options(config)
    model = GlmForCausalLM.from_config(model_config, options=options, device="meta")
    target = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for layer in model.layers:
        if hasattr(layer.self_attn, "resolve_backend"):
            layer.self_attn.resolve_backend(target)
    n_params = sum(p.numel() for p in model.parameters())
    seq = config.seq_len
    cuda = torch.cuda.is_available()
    act_bytes = 2  # the sizes describe the GPU run: bf16 autocast activations
    kda_note = "" if cuda else (
        "  (on CUDA with fla-core installed, `pip install -e '.[gpu]'`, KDA layers run fla's chunk_kda)"
    )
    guard = (
        f"  S x S guard: refuse dense paths above {options.forbid_dense_above:,} tokens"
        if options.forbid_dense_above else "  S x S guard: off"
    )
    lines = [
        (
            f"run {config.run}: model {config.model or 'not set, sized as glm-5.3-flash'} "
            f"({n_params / 1e9:.2f}B parameters, "
            f"{len(model_config.kda_layers)} KDA + {len(model_config.dsa_layers)} DSA layers), "
            f"windows of {seq:,} tokens from {config.data_dir}"
        ),
        (
            f"steps {config.steps or f'from epochs={config.epochs}'}, lr {config.lr} (warmup {config.warmup_steps}, cosine to x{config.min_lr_ratio}), "
            f"grad_accum {config.grad_accum}, clip {config.grad_clip}, "
            f"precision {config.precision} ({'bf16' if config.precision == 'bf16' or (cuda and config.precision == 'auto') else 'fp32'} here), fp32 master weights"
        ),
        "",
        "layer paths:",
        model.path_table(),
        kda_note,
        "",
        "memory switches:",
        f"  {LayerRunner(recompute=config.recompute, offload=config.offload, keep_selection=config.keep_selection).describe()}",
        (
            f"  MoE chunks of {options.moe_chunk_tokens:,} tokens; indexer blocks of {options.indexer_query_block} "
            f"queries; attention blocks of {options.attention_query_block} queries; "
            f"loss chunks of {options.loss_chunk_tokens:,} tokens"
        ),
        guard,
        "",
        (
            f"largest tensors for one {seq:,}-token window on one device, before context parallelism splits the "
            "sequence (bf16 activations):"
        ),
    ]
    rows = largest_tensors(model_config, options, seq, act_bytes, n_params)
    width = max(len(r.name) for r in rows)
    shape_width = max(len(r.shape) for r in rows)
    for row in rows:
        lines.append(f"  {row.name:<{width}}  {row.shape:<{shape_width}}  {row.bytes / GB:>10.2f} GB  {row.where}")
    return "\n".join(lines)

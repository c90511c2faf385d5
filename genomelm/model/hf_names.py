"""Tensor names of GLM-5.3-Flash checkpoints: the official Hugging Face layout <-> genomelm's internal names.

Two spellings of the same weights:
- internal: transformers' `Glm5NextTextModel` parameter names (`layers.3.attn_hc.fn`,
  `layers.5.mlp.experts.gate_up_proj` [E, 2I, D], `layers.0.self_attn.conv1d.weight`), plus `lm_head.weight`;
  `GlmForCausalLM.state_dict()` uses them.
- official: the on-disk layout of `zai-org/GLM-5.3-Flash`, which is also what transformers' `save_pretrained`
  writes (it reverts its load-time conversion mapping): text weights under `model.language_model.` (no prefix
  when a bare `Glm5NextTextModel` was saved), `lm_head.weight` at the top, `hc_attn_fn`, one 2D
  `mlp.experts.E.{gate,up,down}_proj.weight` per expert, `self_attn.{q,k,v}_conv1d.weight`,
  `self_attn.{f_a_proj,f_b_proj,dt_bias,A_log}`.

An internal tensor is one official tensor or the concatenation of several pieces (conv thirds, per-expert
projections). Reading and writing the files is `checkpoint`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

TEXT_PREFIX = "model.language_model."  # where the official layout keeps the text model
LM_HEAD = "lm_head.weight"
CONV_ORDER = ("q", "k", "v")  # official conv pieces, in the order of the internal conv1d's channels

# A piece of an internal tensor: () the whole tensor, ("q",) a conv third, (expert, "gate"|"up"|"down") one
# expert's projection.
Piece = tuple[Any, ...]

# prefixes in front of the text model's names, tried in order (official, bare text model last)
_TEXT_PREFIXES = (TEXT_PREFIX, "language_model.", "model.", "")
_VISION_PREFIXES = ("model.visual.", "visual.")
_LAYER = re.compile(r"^layers\.(\d+)\.")
# official -> internal renames (one tensor each)
_HC_OFFICIAL = re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$")
_FORGET_OFFICIAL = re.compile(
    r"^(layers\.\d+\.self_attn)\.(f_a_proj\.weight|f_b_proj\.weight|dt_bias|A_log)$"
)
# official pieces of one internal tensor
_CONV_OFFICIAL = re.compile(r"^(layers\.\d+\.self_attn)\.([qkv])_conv1d\.weight$")
_EXPERT_OFFICIAL = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
# internal names that need splitting when written in the official layout
_HC_INTERNAL = re.compile(r"^(layers\.\d+)\.(attn|ffn)_hc\.(fn|base|scale)$")
_FORGET_INTERNAL = re.compile(r"^(layers\.\d+\.self_attn)\.forget_gate\.(.+)$")
_CONV_INTERNAL = re.compile(r"^(layers\.\d+\.self_attn)\.conv1d\.weight$")
_EXPERTS_INTERNAL = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def text_model_key(disk_key: str) -> str | None:
    """The text-model name inside `disk_key` (prefix removed), or None for vision-tower keys."""
    if disk_key.startswith(_VISION_PREFIXES):
        return None
    if disk_key == LM_HEAD:
        return LM_HEAD
    for prefix in _TEXT_PREFIXES:
        if disk_key.startswith(prefix):
            return disk_key[len(prefix) :]
    raise AssertionError("the empty prefix matches every key")


def internal_piece(text_key: str) -> tuple[str, Piece]:
    """(internal name, piece) that the text-model key `text_key` (official or internal spelling) fills."""
    if match := _HC_OFFICIAL.match(text_key):
        return f"{match[1]}.{match[2]}_hc.{match[3]}", ()
    if match := _FORGET_OFFICIAL.match(text_key):
        return f"{match[1]}.forget_gate.{match[2]}", ()
    if match := _CONV_OFFICIAL.match(text_key):
        return f"{match[1]}.conv1d.weight", (match[2],)
    if match := _EXPERT_OFFICIAL.match(text_key):
        projection = "down_proj" if match[3] == "down" else "gate_up_proj"
        return f"{match[1]}.{projection}", (int(match[2]), match[3])
    return text_key, ()


def layer_of(name: str) -> int | None:
    """Decoder layer index of an internal name, None for top-level tensors (embeddings, final norm, head)."""
    match = _LAYER.match(name)
    return int(match[1]) if match else None


def is_conv_weight(name: str) -> bool:
    """Whether an internal name is a KDA conv weight (official layout: q, k, v thirds)."""
    return _CONV_INTERNAL.match(name) is not None


def is_routed_experts(name: str) -> bool:
    """Whether an internal name is a stacked routed-expert tensor [E, ...] (official: one per expert)."""
    return _EXPERTS_INTERNAL.match(name) is not None


def official_pattern(name: str) -> str:
    """How an internal name is spelled in the official layout (`{q,k,v}`, `<e>` stand for the pieces)."""
    text_name = name
    if match := _HC_INTERNAL.match(name):
        text_name = f"{match[1]}.hc_{match[2]}_{match[3]}"
    elif match := _FORGET_INTERNAL.match(name):
        text_name = f"{match[1]}.{match[2]}"
    elif match := _CONV_INTERNAL.match(name):
        text_name = f"{match[1]}.{{q,k,v}}_conv1d.weight"
    elif match := _EXPERTS_INTERNAL.match(name):
        parts = "down" if match[2] == "down_proj" else "{gate,up}"
        text_name = f"{match[1]}.<e>.{parts}_proj.weight"
    return text_name if name == LM_HEAD else TEXT_PREFIX + text_name


def official_tensors(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The official on-disk (name, tensor) pairs of one internal tensor (views, no copies)."""

    def disk(text_name: str) -> str:
        return text_name if text_name == LM_HEAD else TEXT_PREFIX + text_name

    if match := _HC_INTERNAL.match(name):
        yield disk(f"{match[1]}.hc_{match[2]}_{match[3]}"), tensor
    elif match := _FORGET_INTERNAL.match(name):
        yield disk(f"{match[1]}.{match[2]}"), tensor
    elif match := _CONV_INTERNAL.match(name):
        for which, third in zip(CONV_ORDER, tensor.chunk(3, dim=0)):
            yield disk(f"{match[1]}.{which}_conv1d.weight"), third
    elif match := _EXPERTS_INTERNAL.match(name):
        if match[2] == "down_proj":  # [E, D, I]
            for expert, down in enumerate(tensor):
                yield disk(f"{match[1]}.{expert}.down_proj.weight"), down
        else:  # [E, 2I, D], gate rows first
            for expert, gate_up in enumerate(tensor):
                gate, up = gate_up.chunk(2, dim=0)
                yield disk(f"{match[1]}.{expert}.gate_proj.weight"), gate
                yield disk(f"{match[1]}.{expert}.up_proj.weight"), up
    else:
        yield disk(name), tensor

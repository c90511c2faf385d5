"""Shared helpers for model tests: tiny configs, a transformers oracle with every parameter randomised, and a
genomelm model holding the same weights."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.model.config import KDA

# 1-D parameters drawn around 1 (multiplicative) or around 0 (additive); everything else by fan-in
_AROUND_ONE = ("weight", "scale")
_AROUND_ZERO = ("bias", "base", "e_score_correction_bias", "dt_bias", "A_log")


def tiny_config(**changes: object) -> ModelConfig:
    """The `tiny` preset with field changes (layer schedules default to the preset's, resized if needed)."""
    return dataclasses.replace(ModelConfig.preset("tiny"), **changes)


def kda_moe_config() -> ModelConfig:
    """`tiny` with every layer KDA (no DSA): dense layer 0, MoE layers 1-3."""
    return tiny_config(layer_types=[KDA] * 4)


def randomise_(module: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter and floating buffer with random values of a sensible scale (in place).

    Matrices: normal / sqrt(fan-in); norm weights and mHC scales: U(0.5, 1.5); biases, mHC base, router
    correction bias, dt_bias, A_log: normal(0, 0.3); the embedding: normal(0, 1).
    """
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    with torch.no_grad():
        for name in sorted(tensors):
            t = tensors[name]
            if not t.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "embed_tokens" in name:
                value = torch.randn(t.shape, generator=gen)
            elif t.dim() >= 2:
                value = torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5
            elif leaf in _AROUND_ZERO:
                value = torch.randn(t.shape, generator=gen) * 0.3
            elif leaf in _AROUND_ONE:
                value = 0.5 + torch.rand(t.shape, generator=gen)
            else:
                raise AssertionError(f"no randomisation rule for {name}")
            t.copy_(value.to(t.dtype))


def oracle_config(config: ModelConfig) -> Glm5NextTextConfig:
    fields = config.text_config_dict()
    fields.pop("model_type")
    ref_config = Glm5NextTextConfig(**fields)
    ref_config._attn_implementation = "eager"
    return ref_config


def build_pair(
    config: ModelConfig, options: RunOptions | None = None, seed: int = 0
) -> tuple[Glm5NextTextModel, Tensor, GlmForCausalLM]:
    """(transformers model, lm_head weight [V, D], genomelm model with the same weights), fp32, eval mode."""
    torch.manual_seed(seed)
    ref = Glm5NextTextModel(oracle_config(config)).float().eval()
    randomise_(ref, seed)
    head = torch.randn(
        config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(seed + 1)
    )
    head = head * config.hidden_size**-0.5
    ours = GlmForCausalLM(config, options).float()
    ours.load_state_dict(ref.state_dict() | {"lm_head.weight": head.clone()}, strict=True)
    return ref, head, ours


def oracle_logprobs(ref: Glm5NextTextModel, head: Tensor, input_ids: Tensor) -> Tensor:
    """log p(x[t+1] | x[<=t]) from the transformers model: [B, S-1]."""
    hidden = ref(input_ids=input_ids, use_cache=False).last_hidden_state
    logp = torch.log_softmax((hidden[:, :-1] @ head.T).float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def random_tokens(batch: int, seq_len: int, vocab: int, seed: int) -> Tensor:
    """Token ids avoiding the pad id 0: [B, S] long."""
    return torch.randint(1, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(seed))

"""Mixture of experts: fp32 sigmoid router with correction bias and group-limited top-k, routed experts, shared expert.

The sequence is routed and computed `options.moe_chunk_tokens` tokens at a time, so working memory is bounded by
the chunk size times `num_experts_per_tok` whatever the length or the routing balance. Two backends give the same
numbers: "grouped" sorts a chunk's (token, expert) pairs by expert and runs each expert once on its contiguous
slice; "loop" is the readable reference (each expert gathers its tokens with a mask).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .config import ModelConfig, RunOptions
from .mlp import MLP, clamped_swiglu

MOE_BACKENDS = ("grouped", "loop")


class TopkRouter(nn.Module):
    """Chooses `num_experts_per_tok` experts per token. `weight` [E, D] and `e_score_correction_bias` [E] are fp32."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x: [T, D] -> (expert ids [T, k] long, weights [T, k] fp32).

        Scores are sigmoid(logits); the bias only steers the choice (group scores = sum of each group's two best
        biased scores; experts outside the `topk_group` best groups are excluded); the weights are the unbiased
        scores of the chosen experts, normalised to sum 1 (if `norm_topk_prob`) and times `routed_scaling_factor`.
        """
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        biased = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = biased.unflatten(-1, (self.n_group, self.num_experts // self.n_group))
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            kept_groups = group_scores.topk(self.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
            biased = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
        expert_ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor


class Experts(nn.Module):
    """Routed expert weights: `gate_up_proj` [E, 2I, D] (gate rows first), `down_proj` [E, D, I]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.swiglu_limit = config.swiglu_limit

    def expert_forward(self, expert: int, x: Tensor) -> Tensor:
        """One expert's clamped SwiGLU on x [n, D] -> [n, D]."""
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)
        return F.linear(clamped_swiglu(gate, up, self.swiglu_limit), self.down_proj[expert])

    def grouped(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Sum of weighted expert outputs per token, pairs sorted by expert.

        x [T, D], expert_ids/weights [T, k] -> (out [T, D], tokens per expert [E] long).
        """
        k = expert_ids.shape[1]
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of_pair = order // k
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        x_sorted = x[token_of_pair]
        pieces = []
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                pieces.append(self.expert_forward(expert, x_sorted[start : start + count]))
                start += count
        y_sorted = torch.cat(pieces) * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, token_of_pair, y_sorted.to(x.dtype))
        return out, counts

    def loop(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Readable reference of `grouped`: each expert picks its tokens with a mask. Same shapes."""
        out = torch.zeros_like(x)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        for expert in range(self.num_experts):
            token, slot = torch.nonzero(expert_ids == expert, as_tuple=True)
            counts[expert] = token.numel()
            if token.numel():
                y = self.expert_forward(expert, x[token]) * weights[token, slot].unsqueeze(-1)
                out = out.index_add(0, token, y.to(x.dtype))
        return out, counts


class MoE(nn.Module):
    """Routed experts (module names `gate`, `experts`) plus one always-on shared expert (`shared_experts`)."""

    def __init__(self, config: ModelConfig, options: RunOptions) -> None:
        super().__init__()
        if options.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {options.moe_backend!r}")
        if options.moe_chunk_tokens < 1:
            raise ValueError(f"moe_chunk_tokens must be positive, got {options.moe_chunk_tokens}")
        self.gate = TopkRouter(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts)
        self.backend = options.moe_backend
        self.chunk_tokens = options.moe_chunk_tokens
        self.path = (
            f"moe: {self.backend}, {config.n_routed_experts} experts top-{config.num_experts_per_tok}, "
            f"chunks of {self.chunk_tokens} tokens"
        )
        self.tokens_per_expert: Tensor | None = None  # [E] long, of the last forward

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, S, D] -> [B, S, D]. Records `tokens_per_expert` (detached).

        With gradients on, each chunk runs under `torch.utils.checkpoint`, so autograd keeps only the chunk's
        input and the backward pass recomputes one chunk's expert activations at a time.
        """
        flat = x.reshape(-1, x.shape[-1])
        outputs = []
        counts = torch.zeros(self.experts.num_experts, dtype=torch.long, device=x.device)
        chunks = flat.split(self.chunk_tokens)
        for chunk in chunks:
            if torch.is_grad_enabled() and len(chunks) > 1:
                out, chunk_counts = checkpoint(self._chunk_forward, chunk, use_reentrant=False)
            else:
                out, chunk_counts = self._chunk_forward(chunk)
            outputs.append(out)
            counts += chunk_counts
        self.tokens_per_expert = counts.detach()
        return torch.cat(outputs).view_as(x)

    def _chunk_forward(self, chunk: Tensor) -> tuple[Tensor, Tensor]:
        """Routed experts + shared expert for [T, D] tokens -> ([T, D], tokens per expert [E])."""
        compute = self.experts.grouped if self.backend == "grouped" else self.experts.loop
        expert_ids, weights = self.gate(chunk)
        routed, counts = compute(chunk, expert_ids, weights)
        return routed + self.shared_experts(chunk), counts

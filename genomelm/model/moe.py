"""Mixture of experts: fp32 sigmoid router with correction bias and group-limited top-k, routed experts,
shared expert.

The sequence is routed and computed `options.moe_chunk_tokens` tokens at a time, so working memory is bounded
by the chunk size times `num_experts_per_tok` whatever the length or the routing balance. Two backends give
the same numbers: "grouped" sorts a chunk's (token, expert) pairs by expert and runs all experts in one
grouped GEMM over the expert offsets (`torch._grouped_mm`; where the device or dtype lacks it, a loop over
the experts' slices of one `unbind`, so the backward writes one stacked gradient, never a full-size buffer
per expert); "loop" is the readable reference (each expert gathers its tokens with a mask).

Precision: routing (logits, sigmoid scores, group and top-k choice, combine weights) runs in fp32 with
autocast off; the expert GEMMs follow the caller's autocast (bf16 on GPUs), or with `expert_precision`
fp8_rowwise / mxfp8 run quantised as torchao's MoE training does (`expert_precision.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .chunking import ChunkRunner, run_directly
from .config import ModelConfig, RunOptions
from .expert_precision import check_device, check_expert_precision, low_precision_grouped_linear
from .mlp import MLP, clamped_swiglu
from .precision import compute_dtype, fp32_region

MOE_BACKENDS = ("grouped", "loop")


class TopkRouter(nn.Module):
    """Chooses `num_experts_per_tok` experts per token. `weight` [E, D] and `e_score_correction_bias` [E]
    are fp32."""

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
        """x: [T, D] -> (expert ids [T, k] long, weights [T, k] fp32), all in fp32 whatever the autocast.

        Scores are sigmoid(logits); the bias only steers the choice (group scores = sum of each group's two
        best biased scores; experts outside the `topk_group` best groups are excluded); the weights are the
        unbiased scores of the chosen experts, normalised to sum 1 (if `norm_topk_prob`) and times
        `routed_scaling_factor`.
        """
        with fp32_region(x):
            scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
            biased = scores.detach() + self.e_score_correction_bias.float()
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


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` runs for this device and dtype (CPU: fp32 and bf16; CUDA: bf16)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)


class Experts(nn.Module):
    """Routed expert weights: `gate_up_proj` [E, 2I, D] (gate rows first), `down_proj` [E, D, I]."""

    def __init__(self, config: ModelConfig, backend: str = "grouped", precision: str = "bf16") -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        check_expert_precision(precision, (d, i))
        if precision != "bf16" and backend != "grouped":
            raise ValueError(f"expert_precision={precision} runs the grouped GEMM: set moe_backend=grouped")
        self.num_experts = e
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.swiglu_limit = config.swiglu_limit
        self.backend = backend
        self.precision = precision  # `EXPERT_PRECISIONS`: what the grouped GEMMs quantise their operands to
        # the place in the MoE's forward of the chunk being run (set by `MoE`): lets a module that splits the
        # experts over processes find what it kept of this chunk when a recompute runs it again
        self.chunk_index = 0
        # set by a module that splits the experts over processes: given, before the first chunk runs, a way to
        # route every chunk (-> each chunk's expert ids [T_c, k]) and the chunks' tokens, so it can exchange
        # all of a layer's split sizes at once and send a chunk's rows ahead of its turn; what it returns,
        # if not None, the MoE hands every chunk's forward as `copies` (weights fetched once per layer pass)
        self.plan_chunks: (
            Callable[[Callable[[], list[Tensor]], list[Tensor]], tuple[Tensor, Tensor] | None] | None
        ) = None
        # set by the same module where the rows' results travel back: the MoE then hands `forward` its shared
        # expert (`beside`) to run while they do
        self.runs_beside = False

    def forward(
        self, x: Tensor, expert_ids: Tensor, weights: Tensor, beside: Callable[[], Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Sum of weighted expert outputs per token: x [T, D], expert_ids/weights [T, k] -> (out [T, D],
        tokens per expert [E] long). `beside`: more work on the same tokens, whose [T, D] result is added to
        out (here after the experts; a module that sends the rows away runs it while they travel)."""
        routed, counts = (
            self.loop(x, expert_ids, weights)
            if self.backend == "loop"
            else self.grouped(x, expert_ids, weights)
        )
        return (routed if beside is None else routed + beside()), counts

    def grouped(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """`forward` with the (token, expert) pairs sorted by expert and one grouped GEMM per projection."""
        k = expert_ids.shape[1]
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        token_of_pair = order // k
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        x_sorted = x[token_of_pair].to(compute_dtype(x))
        y_sorted = self.expert_rows(x_sorted, counts)
        y_sorted = y_sorted * weights.reshape(-1)[order].unsqueeze(-1).to(y_sorted.dtype)
        out = torch.zeros_like(x).index_add_(0, token_of_pair, y_sorted.to(x.dtype))
        return out, counts

    def expert_rows(
        self, x_sorted: Tensor, counts: Tensor, weights: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """The expert MLP of rows sorted by expert: x_sorted [N, D] in the compute dtype, expert e of this
        module's weights owning the next counts[e] rows (counts [E] long, summing to N, N >= 1) -> [N, D] in
        the same dtype. One grouped GEMM per projection where supported, else `_sliced`. (Also the per-rank
        step of expert parallelism, where the module holds a slice of the experts.) `weights`: (gate_up
        [E', 2I, D], down [E', D, I]) to use instead of the module's own, counts then [E'] (expert
        parallelism passes its own experts and copies of other ranks')."""
        dtype = x_sorted.dtype
        if self.precision != "bf16":  # quantised as torchao does, from the weights in the compute dtype
            check_device(self.precision, x_sorted.device)
            gate_up, down = self.weights_in(dtype, weights)
            gate_up_rows = low_precision_grouped_linear(x_sorted, gate_up, counts, self.precision)
            hidden = clamped_swiglu(*gate_up_rows.chunk(2, dim=-1), self.swiglu_limit)
            return low_precision_grouped_linear(hidden, down, counts, self.precision)
        if grouped_mm_supported(x_sorted.device, dtype):
            offsets = counts.cumsum(0).to(torch.int32)
            gate_up, down = self.weights_in(dtype, weights)
            gate, up = _grouped_linear(x_sorted, gate_up, offsets).chunk(2, dim=-1)
            hidden = clamped_swiglu(gate, up, self.swiglu_limit)
            return _grouped_linear(hidden, down, offsets)
        return self._sliced(x_sorted, counts, weights)

    def weights_in(
        self, dtype: torch.dtype, weights: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """(gate_up_proj, down_proj), or `weights`, in `dtype`: work per expert, not per row (the planner
        tells them apart by this method's name)."""
        gate_up, down = weights or (self.gate_up_proj, self.down_proj)
        return gate_up.to(dtype), down.to(dtype)

    def _sliced(
        self, x_sorted: Tensor, counts: Tensor, weights: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """Fallback of the grouped GEMM: each expert on its contiguous slice. The weights are split with one
        `unbind`, whose backward stacks the experts' gradients once (indexing `gate_up_proj[e]` per expert
        would allocate a zero gradient the size of the whole parameter for each expert)."""
        gate_up, down = (w.unbind(0) for w in weights or (self.gate_up_proj, self.down_proj))
        pieces, start = [], 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                rows = x_sorted[start : start + count]
                gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
                pieces.append(F.linear(clamped_swiglu(gate, up, self.swiglu_limit), down[expert]))
                start += count
        return torch.cat(pieces) if pieces else x_sorted.new_zeros(0, x_sorted.shape[-1])

    def loop(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
        """Readable reference of `grouped`: each expert picks its tokens with a mask. Same shapes."""
        out = torch.zeros_like(x)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device)
        for expert in range(self.num_experts):
            token, slot = torch.nonzero(expert_ids == expert, as_tuple=True)
            counts[expert] = token.numel()
            if token.numel():
                gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
                y = F.linear(clamped_swiglu(gate, up, self.swiglu_limit), self.down_proj[expert])
                out = out.index_add(0, token, (y * weights[token, slot].unsqueeze(-1)).to(x.dtype))
        return out, counts


def _grouped_linear(x_sorted: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """Rows of x_sorted [T, in] times their expert's weight [E, out, in]^T -> [T, out]; expert e owns rows
    offsets[e-1]..offsets[e]-1 (int32 cumulative counts)."""
    return torch._grouped_mm(_ContiguousGrad.apply(x_sorted), weight.transpose(-2, -1), offs=offsets)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward rejects expanded
    ones)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad.contiguous()


class MoE(nn.Module):
    """Routed experts (module names `gate`, `experts`) plus one always-on shared expert (`shared_experts`)."""

    def __init__(self, config: ModelConfig, options: RunOptions) -> None:
        super().__init__()
        if options.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"moe_backend must be one of {MOE_BACKENDS}, got {options.moe_backend!r}")
        if options.moe_chunk_tokens < 1:
            raise ValueError(f"moe_chunk_tokens must be positive, got {options.moe_chunk_tokens}")
        self.gate = TopkRouter(config)
        self.experts = Experts(config, options.moe_backend, options.expert_precision)
        self.shared_experts = MLP(config, config.moe_intermediate_size * config.n_shared_experts)
        self.chunk_tokens = options.moe_chunk_tokens
        self.chunk_runner: ChunkRunner = run_directly
        self.route = (
            f"moe: {options.moe_backend}, "
            + (f"{options.expert_precision} expert GEMMs, " if options.expert_precision != "bf16" else "")
            + f"{config.n_routed_experts} experts top-{config.num_experts_per_tok}, "
            f"chunks of {self.chunk_tokens} tokens"
        )
        self.tokens_per_expert: Tensor | None = None  # [E] long, of the last forward

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, S, D] -> [B, S, D]. Records `tokens_per_expert` (detached); each chunk runs through
        `chunk_runner`."""
        flat = x.reshape(-1, x.shape[-1])
        chunks = flat.split(self.chunk_tokens)
        planned = None
        if self.experts.plan_chunks is not None:
            # every chunk routed ahead of the first, where the experts ask for it: the chunks' forwards route
            # again (in their own recompute regions, with autograd) and choose the same experts, as the same
            # ops on the same rows
            planned = self.experts.plan_chunks(
                lambda: [self.gate(chunk)[0] for chunk in chunks], list(chunks)
            )
        outputs = []
        counts = torch.zeros(self.experts.num_experts, dtype=torch.long, device=x.device)
        for index, chunk in enumerate(chunks):
            out, chunk_counts = self.chunk_runner(self._chunk_forward, chunk, index, planned)
            outputs.append(out)
            counts += chunk_counts
        self.tokens_per_expert = counts.detach()
        return torch.cat(outputs).view(*x.shape[:-1], -1)

    def _chunk_forward(
        self, chunk: Tensor, index: int = 0, planned: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """Routed experts + shared expert for [T, D] tokens -> ([T, D], tokens per expert [E]). `index`: the
        chunk's place in the forward, told to the experts (`Experts.chunk_index`); a recompute replays it.
        `planned`: what the experts' `plan_chunks` returned, handed to them as `copies` (an argument, so a
        chunk's recompute gets the same tensors)."""
        self.experts.chunk_index = index
        expert_ids, weights = self.gate(chunk)
        extra = {} if planned is None else {"copies": planned}  # only a module that fetched copies takes it
        if self.experts.runs_beside:  # the shared expert runs while the routed rows' results travel back
            return self.experts(
                chunk, expert_ids, weights, beside=lambda: self.shared_experts(chunk), **extra
            )
        routed, counts = self.experts(chunk, expert_ids, weights, **extra)
        return routed + self.shared_experts(chunk), counts

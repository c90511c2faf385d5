"""DeepSeek Sparse Attention (DSA) layer of GLM-5.3-Flash: NoPE MLA over indexer-selected tokens.

Each query reads W = index_topk + kpool - 1 token slots (its selected pools expanded to tokens plus the
incomplete tail pool). The fast path works in absorbed-latent form: W_uk is folded into the query so scores
are q_lat . latent[selected] over the kv_lora_rank-wide latent, and W_uv is applied after the weighted sum of
latents. Queries run in blocks of `RunOptions.attention_query_block`; a custom autograd function recomputes
each block in backward and scatter-adds the gathered latents' gradient into one [B, S, kv_lora_rank] buffer,
so a layer's forward + backward working set is bounded by the block ([B, block, W, kv_lora_rank]), not by S.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genomelm.model.config import ModelConfig, RunOptions
from genomelm.model.dsa_naive import check_dense_allowed, dense_dsa_attention
from genomelm.model.indexer import Indexer, Selection
from genomelm.model.norms import RMSNorm


class DSAAttention(nn.Module):
    """MLA (low-rank q and kv, NoPE) restricted to the k-pool indexer's selection.

    Parameter names follow transformers' `Glm5NextTextAttention`. A "full" layer owns an `indexer`; a
    "shared" layer has none and attends over the `Selection` of an earlier full layer.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, options: RunOptions | None = None) -> None:
        super().__init__()
        if config.qk_rope_head_dim != 0:
            raise ValueError("DSAAttention is NoPE: qk_rope_head_dim must be 0")
        if not config.index_kpool_always_select_tail and config.index_kpool > 1:
            raise ValueError(
                "index_kpool_always_select_tail=False leaves the first kpool-1 queries nothing to attend to; "
                "GLM-5.3-Flash uses True"
            )
        self.options = options if options is not None else RunOptions()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope_dim = config.qk_nope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.scaling = config.qk_head_dim**-0.5
        bias = config.attention_bias
        self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.nope_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_lora_rank, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=bias)
        shared = config.indexer_types[layer_idx] == "shared"
        self.indexer = None if shared else Indexer(config, self.options)
        self.slots = config.index_topk + config.index_kpool - 1
        self.indexer_loss: Tensor | None = None
        if self.options.dsa_backend == "dense":
            self.path = "dsa: dense S x S reference"
        elif self.options.dsa_backend == "sparse":
            self.path = (
                f"dsa: sparse gather ({self.slots} slots), indexer blocks of {self.options.indexer_query_block} "
                f"queries, attention blocks of {self.options.attention_query_block} queries"
            )
        else:
            raise ValueError(f"dsa_backend must be 'sparse' or 'dense', got {self.options.dsa_backend!r}")
        if shared:
            self.path += ", shared selection"

    def forward(self, x: Tensor, shared_selection: Selection | None = None) -> tuple[Tensor, Selection]:
        """x [B, S, hidden_size] -> (output [B, S, hidden_size], the selection used).

        Shared layers need `shared_selection` (from the most recent full DSA layer); full layers ignore it.
        """
        batch, seq_len, _ = x.shape
        if self.options.dsa_backend == "dense":
            check_dense_allowed(seq_len, self.options.forbid_dense_above)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))
        if self.indexer is not None:
            selection = self.indexer.select(x, q_resid)
        elif shared_selection is None:
            raise ValueError(
                f"layer {self.layer_idx} shares its indexer: pass the selection of a full DSA layer"
            )
        else:
            selection = shared_selection
            if selection.pools.shape[:2] != (batch, seq_len):
                raise ValueError(
                    f"shared selection is for {tuple(selection.pools.shape[:2])}, input is {(batch, seq_len)}"
                )

        train_indexer = self.options.train_indexer and self.indexer is not None
        if self.options.dsa_backend == "dense":
            out = dense_dsa_attention(
                q_resid,
                latent,
                selection.token_indices(),
                self.q_b_proj,
                self.kv_b_proj,
                self.o_proj,
                self.num_heads,
                self.nope_dim,
                self.v_dim,
                self.scaling,
                self.options.forbid_dense_above,
            )
            pool_mass = self._pool_mass_dense(q_resid, latent, selection) if train_indexer else None
        else:
            out, pool_mass = _BlockedSparseMLA.apply(
                self,
                selection,
                train_indexer,
                q_resid,
                latent,
                self.q_b_proj.weight,
                self.kv_b_proj.weight,
                self.o_proj.weight,
                self.o_proj.bias,
            )
        self.indexer_loss = self.indexer.kl_loss(x, q_resid, selection, pool_mass) if train_indexer else None
        return out, selection

    # ------------------------------------------------------------ one query block
    def attend_block(
        self,
        q_resid: Tensor,
        gathered: Tensor,
        valid: Tensor,
        q_b_w: Tensor,
        kv_b_w: Tensor,
        o_w: Tensor,
        o_b: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """Absorbed-latent attention of b queries over their gathered slots.

        q_resid [B, b, q_lora_rank], gathered latents [B, b, W, kv_lora_rank], valid [B, b, W] bool ->
        (output [B, b, hidden_size], attention probabilities [B, b, H, W]).
        """
        batch, block, _ = q_resid.shape
        q = F.linear(q_resid, q_b_w).view(batch, block, self.num_heads, self.nope_dim)
        w_kv = kv_b_w.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim :]
        q_lat = torch.einsum("bqhd,hdl->bqhl", q, w_uk)
        scores = torch.matmul(q_lat, gathered.transpose(-1, -2)) * self.scaling  # [B, b, H, W]
        scores = scores.masked_fill(~valid[:, :, None, :], torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out_lat = torch.matmul(probs, gathered)  # [B, b, H, kv_lora_rank]
        out = torch.einsum("bqhl,hdl->bqhd", out_lat, w_uv).reshape(batch, block, self.num_heads * self.v_dim)
        return F.linear(out, o_w, o_b), probs

    def pool_mass_of(self, probs: Tensor, pools_per_query: int, kpool: int) -> Tensor:
        """Attention probabilities [B, b, H, W] -> mass per selected pool summed over heads [B, b, K] fp32."""
        batch, block = probs.shape[:2]
        pooled = probs[..., : pools_per_query * kpool].float().sum(2)
        return pooled.view(batch, block, pools_per_query, kpool).sum(-1)

    def _pool_mass_dense(self, q_resid: Tensor, latent: Tensor, selection: Selection) -> Tensor:
        """Head-summed attention mass per selected pool for the dense backend (small S): [B, S, K]."""
        with torch.no_grad():
            index, valid = gather_indices(selection, 0, q_resid.shape[1])
            _, probs = self.attend_block(
                q_resid,
                gather_latents(latent, index),
                valid,
                self.q_b_proj.weight,
                self.kv_b_proj.weight,
                self.o_proj.weight,
                self.o_proj.bias,
            )
            return self.pool_mass_of(probs, selection.pools.shape[-1], selection.kpool)


def gather_indices(selection: Selection, start: int, end: int) -> tuple[Tensor, Tensor]:
    """Slots of queries start..end-1: (token positions clamped to >= 0 [B, b, W] int64, valid [B, b, W] bool)."""
    tokens = selection.token_indices(start, end)
    return tokens.clamp(min=0), tokens >= 0


def gather_latents(latent: Tensor, index: Tensor) -> Tensor:
    """latent [B, S, L], index [B, b, W] -> [B, b, W, L]."""
    batch = latent.shape[0]
    return latent[torch.arange(batch, device=latent.device)[:, None, None], index]


class _BlockedSparseMLA(torch.autograd.Function):
    """Blocked sparse attention with per-block recompute in backward.

    Forward runs `attend_block` block by block without a graph; backward recomputes each block with a local
    graph, adds its weight gradients, writes its q_resid rows and scatter-adds (index_add_) the gathered
    latents' gradient into one [B, S, L] buffer. Returns (output [B, S, D], pool mass [B, S, K] fp32 or None).
    """

    @staticmethod
    def forward(
        ctx: Any,
        attn: DSAAttention,
        selection: Selection,
        want_pool_mass: bool,
        q_resid: Tensor,
        latent: Tensor,
        q_b_w: Tensor,
        kv_b_w: Tensor,
        o_w: Tensor,
        o_b: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        batch, seq_len, _ = q_resid.shape
        block = max(1, attn.options.attention_query_block)
        pools_per_query = selection.pools.shape[-1]
        out = q_resid.new_empty(batch, seq_len, o_w.shape[0])
        pool_mass = (
            q_resid.new_empty(batch, seq_len, pools_per_query, dtype=torch.float32)
            if want_pool_mass
            else None
        )
        for start in range(0, seq_len, block):
            end = min(start + block, seq_len)
            index, valid = gather_indices(selection, start, end)
            out_block, probs = attn.attend_block(
                q_resid[:, start:end], gather_latents(latent, index), valid, q_b_w, kv_b_w, o_w, o_b
            )
            out[:, start:end] = out_block
            if pool_mass is not None:
                pool_mass[:, start:end] = attn.pool_mass_of(probs, pools_per_query, selection.kpool)
        ctx.attn, ctx.selection, ctx.block = attn, selection, block
        ctx.save_for_backward(q_resid, latent, q_b_w, kv_b_w, o_w, o_b)
        if pool_mass is not None:
            ctx.mark_non_differentiable(pool_mass)
        return out, pool_mass

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, _grad_pool_mass: Tensor | None) -> tuple[Tensor | None, ...]:
        q_resid, latent, *weights = ctx.saved_tensors
        attn, selection, block = ctx.attn, ctx.selection, ctx.block
        batch, seq_len, latent_dim = latent.shape
        need = ctx.needs_input_grad[3:]
        grad_q_resid = torch.zeros_like(q_resid) if need[0] else None
        grad_latent = torch.zeros(batch * seq_len, latent_dim, dtype=latent.dtype, device=latent.device)
        weight_leaves = [
            w.detach().requires_grad_(n) if w is not None else None for w, n in zip(weights, need[2:])
        ]
        grad_weights: list[Tensor | None] = [None] * len(weights)
        row_offset = (torch.arange(batch, device=latent.device) * seq_len)[:, None, None]
        for start in range(0, seq_len, block):
            end = min(start + block, seq_len)
            index, valid = gather_indices(selection, start, end)
            with torch.enable_grad():
                q_leaf = q_resid[:, start:end].detach().requires_grad_(need[0])
                gathered = gather_latents(latent, index).detach().requires_grad_(need[1])
                out_block, _ = attn.attend_block(q_leaf, gathered, valid, *weight_leaves)
                leaves = [q_leaf, gathered, *weight_leaves]
                wanted = [t for t in leaves if t is not None and t.requires_grad]
                grads = iter(torch.autograd.grad(out_block, wanted, grad_out[:, start:end]))
            grads_all = [next(grads) if t is not None and t.requires_grad else None for t in leaves]
            if grads_all[0] is not None:
                grad_q_resid[:, start:end] = grads_all[0]
            if grads_all[1] is not None:
                g = grads_all[1].masked_fill(~valid[..., None], 0.0)
                grad_latent.index_add_(0, (index + row_offset).flatten(), g.flatten(0, 2))
            for i, g in enumerate(grads_all[2:]):
                if g is not None:
                    grad_weights[i] = g if grad_weights[i] is None else grad_weights[i] + g
        grad_latent_out = grad_latent.view(batch, seq_len, latent_dim) if need[1] else None
        return (None, None, None, grad_q_resid, grad_latent_out, *grad_weights)

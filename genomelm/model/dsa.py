"""DeepSeek Sparse Attention (DSA) layer of GLM-5.3-Flash: NoPE MLA over indexer-selected tokens.

The layer works in absorbed-latent form: W_uk is folded into the query (`absorbed_queries`), the sparse core
(`dsa_sparse.sparse_latent_attention`) attends over each query's selected tokens in the kv_lora_rank-wide
latent, and W_uv then o_proj map its output back (`project_out`); both projections run once over the whole
sequence (autograd), around the core. `dsa_backend` picks the core: "sparse" (the torch gather, the readable
reference), "triton" (`dsa_triton`: the same maths fused into kernels), "auto" (triton on CUDA, sparse
elsewhere; resolved at the first forward from the input's device and named in `route`), or "dense" (the
S x S reference, `dsa_naive`).

The forward is two seams, so that context parallelism (`genomelm.parallel`) can run between them without
the model knowing about processes: `project` (the local projections: queries, normalised latent, the
indexer's pooled keys) and `attend` (given the whole window's latent and pooled keys and the queries' global
positions: select, attend, project out). The plain forward composes them with nothing in between.

Precision: the latent is kept in the compute dtype (bf16 under bf16 autocast); see `dsa_sparse` for the core.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from genomelm.model.backends import TRITON, resolve_backend
from genomelm.model.config import ModelConfig, RunOptions
from genomelm.model.dsa_naive import check_dense_allowed, dense_dsa_attention
from genomelm.model.dsa_sparse import (
    attend_block,
    gather_indices,
    gather_latents,
    pool_mass_of,
    query_positions,
    sparse_latent_attention,
)
from genomelm.model.indexer import Indexer, Selection, Spans, whole_window
from genomelm.model.norms import RMSNorm
from genomelm.model.precision import compute_dtype

BACKENDS = ("auto", TRITON, "sparse", "dense")  # values of RunOptions.dsa_backend


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
        self.kpool = config.index_kpool
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
        if self.options.dsa_backend not in BACKENDS:
            raise ValueError(f"dsa_backend must be one of {BACKENDS}, got {self.options.dsa_backend!r}")
        # "auto" and "triton" resolve at the first forward, from the input's device (`resolve_backend`)
        self.backend: str | None = (
            self.options.dsa_backend if self.options.dsa_backend in ("sparse", "dense") else None
        )
        self.route = self._route_base = ""
        self._refresh_route()

    def forward(
        self, x: Tensor, shared_selection: Selection | None = None, selection_cache: dict | None = None
    ) -> tuple[Tensor, Selection]:
        """x [B, S, hidden_size] -> (output [B, S, hidden_size], the selection used).

        Shared layers need `shared_selection` (from the most recent full DSA layer); full layers ignore it.
        `selection_cache`: a dict owned by the caller for one forward + recompute of this layer; a full layer
        stores its selection there on the first call and reuses it on the recompute instead of re-running the
        indexer (the selection takes no gradient, so the numbers are the same).
        """
        q_resid, latent, pool_keys = self.project(x, self.needs_pool_keys(selection_cache))
        spans = whole_window(x.shape[1])
        return self.attend(x, q_resid, latent, pool_keys, spans, shared_selection, selection_cache)

    def needs_pool_keys(self, selection_cache: dict | None) -> bool:
        """Whether `attend` needs the pooled keys: to run the indexer (a full layer without a cached
        selection) or for its KL term (`train_indexer`)."""
        cached = selection_cache is not None and selection_cache.get("selection") is not None
        return self.indexer is not None and (self.options.train_indexer or not cached)

    def project(self, x: Tensor, with_pool_keys: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """The per-token projections of x [B, n, hidden_size]: (q_resid [B, n, q_lora_rank], latent
        [B, n, kv_lora_rank] after kv_a_layernorm, and when `with_pool_keys` the indexer's keys of the
        complete pools in x [B, n // kpool, index_head_dim], else None).

        The latent comes in the compute dtype, which every reader of it casts to anyway (bf16 under bf16
        autocast: what a context-parallel gather moves). The pooled keys come from the detached x and keep a
        graph (to the indexer's parameters) only for the KL term of `train_indexer`.
        """
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)).to(compute_dtype(x))
        pool_keys = None
        if with_pool_keys:
            if self.indexer is None:
                raise ValueError(f"layer {self.layer_idx} shares its indexer: it has no pooled keys")
            with torch.set_grad_enabled(torch.is_grad_enabled() and self.options.train_indexer):
                pool_keys = self.indexer.pool_keys(x.detach())
        return q_resid, latent, pool_keys

    def attend(
        self,
        x: Tensor,
        q_resid: Tensor,
        latent: Tensor,
        pool_keys: Tensor | None,
        spans: Spans,
        shared_selection: Selection | None = None,
        selection_cache: dict | None = None,
        window_sum: Callable[[Tensor], Tensor] | None = None,
    ) -> tuple[Tensor, Selection]:
        """Select and attend for some of a window's queries, against the whole window's keys.

        x [B, n, hidden_size] and q_resid [B, n, q_lora_rank]: the queries' rows, at the global positions
        `spans` names; latent [B, S, kv_lora_rank] and pool_keys [B, S // kpool, index_head_dim]: the whole
        window's, in global order (pool_keys when `needs_pool_keys`, else None). Returns (output [B, n,
        hidden_size], the queries' selection). The plain forward passes every query (spans: the whole window).
        With `train_indexer`, `indexer_loss` is this process's share of the window's KL term: the KL summed
        over these queries, divided by `window_sum` of their count (the count over the whole window; None:
        these queries are the whole window).
        """
        batch, queries, _ = x.shape
        backend = self.resolve_backend(latent.device)
        if backend == "dense":
            check_dense_allowed(latent.shape[1], self.options.forbid_dense_above)
        train_indexer = self.options.train_indexer and self.indexer is not None
        if self.indexer is not None:
            selection = selection_cache.get("selection") if selection_cache is not None else None
            if pool_keys is None and (selection is None or train_indexer):
                raise ValueError(f"layer {self.layer_idx} runs its indexer: pass the window's pooled keys")
            if selection is None:
                selection = self.indexer.select(x, q_resid, pool_keys, spans)
            if selection_cache is not None:
                selection_cache["selection"] = selection
        elif shared_selection is None:
            raise ValueError(
                f"layer {self.layer_idx} shares its indexer: pass the selection of a full DSA layer"
            )
        else:
            selection = shared_selection
            if selection.pools.shape[:2] != (batch, queries):
                raise ValueError(
                    f"shared selection is for {tuple(selection.pools.shape[:2])}, input is {(batch, queries)}"
                )

        if backend == "dense":
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
            q_lat = self.absorbed_queries(q_resid)
            out_lat, pool_mass = self._core(backend, q_lat, latent.to(q_lat.dtype), selection, train_indexer)
            # as large as out_lat and needed no further (the core saves what its backward needs): freed
            # before W_uv's output and its reshape exist, the layer's forward peak at long windows
            del q_lat
            out = self.project_out(out_lat)
        self._refresh_route()
        self.indexer_loss = None
        if train_indexer:
            total, counted = self.indexer.kl_sum(x, q_resid, selection, pool_mass, pool_keys)
            counted = counted if window_sum is None else window_sum(counted)
            self.indexer_loss = total / counted.clamp(min=1)
        return out, selection

    def resolve_backend(self, device: torch.device) -> str:
        """The core's backend for inputs on `device`, chosen at the first call ("auto": the Triton kernel on
        CUDA, the sparse gather elsewhere); names it in `route`."""
        if self.backend is None:
            self.backend = resolve_backend(
                "dsa_backend", self.options.dsa_backend, BACKENDS[1:], "sparse", device
            )
            self._refresh_route()
        return self.backend

    def _core(
        self, backend: str, q_lat: Tensor, latent: Tensor, selection: Selection, want_pool_mass: bool
    ) -> tuple[Tensor, Tensor | None]:
        """The sparse core on `backend`: q_lat [B, n, H, L], latent [B, S, L] -> (out_lat [B, n, H, L],
        the head-summed mass per selected pool [B, n, K] fp32 when `want_pool_mass`, else None)."""
        if backend != TRITON:
            return sparse_latent_attention(
                q_lat, latent, selection, self.scaling, self.options.attention_query_block, want_pool_mass
            )
        from genomelm.model.dsa_triton import sparse_mla  # imports triton: only on this backend

        return sparse_mla(
            q_lat,
            latent,
            selection.pools,
            query_positions(selection, q_lat.device),
            selection.kpool,
            selection.select_tail,
            self.scaling,
            want_pool_mass,
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )

    def _route_name(self) -> str:
        """This layer's path: the core's backend (with its tiling), then the indexer's (or the shared
        selection)."""
        if self.backend is None:
            name = f"dsa: {self.options.dsa_backend} (resolved at the first forward)"
        elif self.backend == "dense":
            name = "dsa: dense S x S reference"
        elif self.backend == "sparse":
            name = (
                f"dsa: sparse gather ({self.slots} slots), "
                f"attention blocks of {self.options.attention_query_block} queries"
            )
        else:
            from genomelm.model.dsa_triton import tiles

            # the backward's d latent reduction follows torch.use_deterministic_algorithms at each call
            reduction = "fixed-order" if torch.are_deterministic_algorithms_enabled() else "fp32 atomic"
            tile = tiles().block_w
            name = f"dsa: triton sparse MLA ({self.slots} slots, tiles of {tile}, {reduction} d latent)"
        if self.indexer is None:
            return name + ", shared selection"
        indexer_route = getattr(self.indexer, "route", None)
        if indexer_route is None:
            return name + f", indexer blocks of {self.options.indexer_query_block} queries"
        return f"{name}, {indexer_route}"

    def _refresh_route(self) -> None:
        """Name the current path in `route`, keeping what a wrapper (context parallelism) appended after the
        previous name."""
        name = self._route_name()
        note = self.route[len(self._route_base) :] if self.route.startswith(self._route_base) else ""
        self._route_base = name
        self.route = name + note

    # ------------------------------------------------------------ absorbed-latent pieces
    def absorbed_queries(self, q_resid: Tensor) -> Tensor:
        """Queries in latent space (W_uk folded in): [B, S, q_lora_rank] -> [B, S, H, kv_lora_rank]."""
        batch, seq_len, _ = q_resid.shape
        q = self.q_b_proj(q_resid).view(batch, seq_len, self.num_heads, self.nope_dim)
        w_uk = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return torch.einsum("bshd,hdl->bshl", q, w_uk[:, : self.nope_dim])

    def project_out(self, out_lat: Tensor) -> Tensor:
        """Attention output in latent space [B, S, H, kv_lora_rank] -> W_uv, then o_proj
        -> [B, S, hidden_size]."""
        batch, seq_len = out_lat.shape[:2]
        w_uv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        out = torch.einsum("bshl,hdl->bshd", out_lat, w_uv[:, self.nope_dim :])
        return self.o_proj(out.reshape(batch, seq_len, self.num_heads * self.v_dim))

    def _pool_mass_dense(self, q_resid: Tensor, latent: Tensor, selection: Selection) -> Tensor:
        """Head-summed attention mass per selected pool for the dense backend (small S): [B, S, K]."""
        with torch.no_grad():
            batch, seq_len, _ = q_resid.shape
            index, valid = gather_indices(selection, 0, seq_len)
            _, probs = attend_block(
                self.absorbed_queries(q_resid).flatten(0, 1),
                gather_latents(latent, index).flatten(0, 1),
                valid.flatten(0, 1),
                self.scaling,
            )
            mass = pool_mass_of(probs, selection.pools.shape[-1], selection.kpool)
            return mass.view(batch, seq_len, -1)

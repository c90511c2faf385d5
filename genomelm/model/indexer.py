"""k-pool lightning indexer of GLM-5.3-Flash's DeepSeek Sparse Attention (DSA) layers.

The indexer picks, for every query token, which earlier tokens the main attention reads. Keys are grouped
into pools of `index_kpool` consecutive tokens (pool p = tokens [p*kpool, (p+1)*kpool)); each complete pool
gets one key (a learned softmax-weighted mix of its tokens' keys), queries score pools, and the
`index_topk / index_kpool` best visible pools are expanded back to tokens. The incomplete pool at the
query (the up to kpool-1 tokens after the last complete visible pool, ending at the query) is always added.

Only the causal, unpadded case is supported (one window per row): the first valid token is position 0.
Scoring runs over blocks of `RunOptions.indexer_query_block` queries, so working memory is
[B, block, index_n_heads, S / kpool], never S x S.

Queries and keys need not be the same tokens: `select` scores the queries it is given (at the global
positions `spans` names) against the pooled keys of the whole window, so under context parallelism each rank
scores only its own queries against gathered keys (`genomelm.parallel`). Ties in the top-k (index scores of
exactly 0 are common: every head's ReLU can be 0) are broken as torch.topk breaks them on a row of every
pool, as transformers does; `select` keeps that whatever the blocking (see `TOPK_SORT_RATIO`), so every split
of the queries, by block or by rank, selects the same pools.

Precision: the projections (wq_b, wk, weights_proj, the pool gate) follow the caller's autocast; the
scores, their ReLU and head-weighted sum, the causal mask, the top-k and the KL term run in fp32 with
autocast off (the KL term in fp64 when its inputs are fp64). `RunOptions.indexer_precision="fp8"` scores
as DeepSeek-V3.2 does: q (per query and head) and the pooled keys (per pool) quantised to e4m3 with
per-row scales (`quantize_fp8_rows`), the key scale applied to the dot product before the ReLU and the
query scale folded into the head weights; the torch path emulates it on the fp8 values in fp32.

Two paths (`RunOptions.indexer_backend`, resolved at the first `select` from the input's device and named
in `route`): the torch path above, and the Triton kernel of `indexer_triton` (the scores fused so the
[B, block, H, P] tensor never exists), whose query blocks are sized from `KERNEL_SCORE_BYTES`, not
`indexer_query_block`. Both take torch.topk of [B, block, P] fp32 rows scored under the same rule, so on the
CPU they select the same pools, ties included. On CUDA, torch.topk's own tie order applies to both; the
kernel path's rows may be longer (bigger blocks), so pools tied at the K-th place may differ there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from genomelm.model.backends import TRITON, resolve_backend
from genomelm.model.chunking import ChunkRunner, run_directly
from genomelm.model.config import ModelConfig, RunOptions
from genomelm.model.precision import at_least_fp32, compute_dtype, fp32_region

# torch.topk on the CPU partially sorts a row (heap selection: a later value enters only if strictly larger,
# so trailing invisible pools never change the result) when k * 64 <= its length, else it uses nth_element,
# whose tie order depends on the whole row: rows are scored in full below this many times k pools, never cut
# below it
TOPK_SORT_RATIO = 64

# the kernel path's [B, block, P] fp32 scores per query block are kept under this many bytes (at 1M tokens,
# 262,144 pools: blocks of 256 queries, 1/16 of the torch path's [B, 128, 32 heads, P] fp32 at 128)
KERNEL_SCORE_BYTES = 256 * 2**20
# e4m3's largest finite value: per-row fp8 scales map each row's absolute maximum onto it
FP8_MAX = 448.0
PRECISIONS = ("bf16", "fp8")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (first global position, length) of each run of consecutive query positions, in local order
Spans = tuple[tuple[int, int], ...]


def whole_window(seq_len: int) -> Spans:
    """The spans of a window's queries held in one piece: ((0, seq_len),)."""
    return ((0, seq_len),)


def span_positions(spans: Spans, device: torch.device | None = None) -> Tensor:
    """Global positions of the queries the spans describe, in local order: [sum of lengths] long."""
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in spans])


def quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (e4m3 values [..., D], fp32 scales [...]) with x ~= values * scale per row: each row's
    absolute maximum maps to FP8_MAX (a zero row gets a tiny scale and zero values)."""
    wide = x.float()
    scale = wide.abs().amax(-1).clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX
    return (wide / scale[..., None]).to(torch.float8_e4m3fn), scale


@dataclass
class Selection:
    """Which tokens each query attends to, kept compactly as selected pools.

    `pools` [B, S, K] int32: start-pool numbers p (tokens p*kpool .. p*kpool+kpool-1) selected for each
    query, by descending indexer score (ties as torch.topk orders them); -1 marks an empty slot (fewer than
    K visible pools). K = index_topk // kpool. The tail (tokens after the query's last complete pool, up to
    the query) is implied by the query position and added when `select_tail`. `positions` [S] long: the
    queries' global positions (None: 0..S-1, the whole window); token numbers are global either way.
    """

    pools: Tensor
    kpool: int
    select_tail: bool
    positions: Tensor | None = None

    @property
    def slots(self) -> int:
        """Tokens per query: K * kpool selected-pool tokens + (kpool - 1) tail tokens."""
        return self.pools.shape[-1] * self.kpool + (self.kpool - 1 if self.select_tail else 0)

    def token_indices(self, start: int = 0, end: int | None = None) -> Tensor:
        """Token positions read by queries start..end-1: [B, end-start, slots] int64, -1 for empty slots."""
        end = self.pools.shape[1] if end is None else end
        pools = self.pools[:, start:end].long()
        batch, queries, _ = pools.shape
        offsets = torch.arange(self.kpool, device=pools.device)
        tokens = (pools[..., None] * self.kpool + offsets).masked_fill(pools[..., None] < 0, -1).flatten(-2)
        if not self.select_tail or self.kpool == 1:
            return tokens
        if self.positions is None:
            position = torch.arange(start, end, device=pools.device)
        else:
            position = self.positions[start:end].to(pools.device)
        tail_count = (position + 1) % self.kpool
        tail_offsets = torch.arange(self.kpool - 1, device=pools.device)
        tail = (position + 1 - tail_count)[:, None] + tail_offsets
        tail = tail.masked_fill(tail_offsets >= tail_count[:, None], -1)
        return torch.cat([tokens, tail.expand(batch, queries, -1)], dim=-1)


class Indexer(nn.Module):
    """Lightning indexer with k-pool compression. Parameter names follow transformers'
    `Glm5NextTextIndexer`."""

    def __init__(self, config: ModelConfig, options: RunOptions | None = None) -> None:
        super().__init__()
        self.options = options if options is not None else RunOptions()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.kpool = config.index_kpool
        self.pools_per_query = config.index_topk // config.index_kpool
        self.select_tail = config.index_kpool_always_select_tail
        self.softmax_scale = self.head_dim**-0.5
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.head_dim, config.hidden_size))
        self.chunk_runner: ChunkRunner = run_directly  # runs each query block of the KL term
        if self.options.indexer_precision not in PRECISIONS:
            raise ValueError(
                f"indexer_precision must be one of {PRECISIONS}, got {self.options.indexer_precision!r}"
            )
        self.fp8 = self.options.indexer_precision == "fp8"
        self.kernel_score_bytes = KERNEL_SCORE_BYTES
        self.backend: str | None = None  # resolved at the first `select`, on the input's device
        self.route = f"indexer: {self.options.indexer_backend} (resolved at the first forward)"

    def resolve_backend(self, device: torch.device) -> str:
        """The scoring path for inputs on `device` ("triton" or "torch"), chosen at the first call; fp8 with
        the kernel needs a Hopper or newer GPU. Names the path in `route`."""
        if self.backend is None:
            backend = resolve_backend(
                "indexer_backend", self.options.indexer_backend, (TRITON, "torch"), "torch", device
            )
            if backend == TRITON and self.fp8 and device.type == "cuda":
                capability = torch.cuda.get_device_capability(device)
                if capability < (9, 0):
                    raise ValueError(
                        f"indexer_precision=fp8 with the Triton kernel needs a Hopper or newer GPU (compute "
                        f"capability 9.0+), this one is {capability[0]}.{capability[1]}: set "
                        "indexer_precision=bf16"
                    )
            self.backend = backend
            fp8 = ", fp8 e4m3 emulated" if self.fp8 else ""
            self.route = f"indexer: torch blocks of {self.options.indexer_query_block} queries{fp8}"
        return self.backend

    def kernel_block(self, batch: int, queries: int, n_pools: int, tile: int) -> int:
        """Queries per block of the kernel path: the most whose fp32 scores against every pool fit
        `kernel_score_bytes`, a multiple of the kernel's query tile, at least one tile, at most the queries
        (rounded up to a tile)."""
        rows = self.kernel_score_bytes // (4 * batch * max(n_pools, 1))
        return max(tile, min(rows, queries + tile - 1) // tile * tile)

    def pool_keys(self, x: Tensor) -> Tensor:
        """Keys of the complete pools: x [B, S, D] -> [B, S // kpool, head_dim] in the compute dtype (bf16
        under bf16 autocast); the pool softmax in fp32 (fp64 for fp64 inputs). Cast explicitly because
        autocast's op lists differ by device (CUDA's runs `layer_norm` and `sum` in fp32, the CPU's in bf16),
        and the keys must be the same on both: they are what a context-parallel gather moves."""
        batch, seq_len, _ = x.shape
        n_pools = seq_len // self.kpool
        keys = self.k_norm(self.wk(x)).to(compute_dtype(x))
        keys = keys[:, : n_pools * self.kpool].view(batch, n_pools, self.kpool, self.head_dim)
        gate = F.linear(x, self.index_kpool_compress_gate)[:, : n_pools * self.kpool]
        wide = at_least_fp32(gate.dtype)
        logits = gate.view(batch, n_pools, self.kpool, self.head_dim).to(wide)
        logits = logits + self.index_kpool_compress_ape.to(wide)
        return (logits.softmax(dim=2).to(keys.dtype) * keys).sum(dim=2).to(keys.dtype)

    def _block_scores(self, x: Tensor, q_resid: Tensor, pool_keys: Tensor, start: int) -> Tensor:
        """Index scores of the queries at global positions start..start+b-1 against the given pools: [B, b, P]
        fp32, invisible pools -inf-like.

        x [B, b, D] and q_resid [B, b, q_lora_rank] are the block's rows; pool_keys [B, P, head_dim] (the
        first P pools; pass only those the block can see to save work). Three passes over the [B, b, H, P]
        scores: the matmul, the in-place scale + ReLU, and the head-weighted sum; the causal mask touches only
        the pools that end inside the block.
        """
        batch, block, _ = x.shape
        n_pools = pool_keys.shape[1]
        q, weights = self._block_queries(x, q_resid)
        with fp32_region(q):
            if self.fp8:
                q, query_scale = quantize_fp8_rows(q)
                pool_keys, key_scale = quantize_fp8_rows(pool_keys)
                weights = weights * query_scale
            scores = torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1))
            if self.fp8:
                scores.mul_((key_scale * self.softmax_scale)[:, None, None, :])
            else:
                scores.mul_(self.softmax_scale)
            index_scores = torch.matmul(weights.unsqueeze(-2), scores.relu_()).squeeze(-2)
        first = min((start + 1) // self.kpool, n_pools)  # pools before this one are visible to every query
        index_scores[..., first:].masked_fill_(
            ~self._visible(start, block, first, n_pools, x.device), torch.finfo(torch.float32).min
        )
        return index_scores

    def _block_queries(self, x: Tensor, q_resid: Tensor) -> tuple[Tensor, Tensor]:
        """The block's index queries [B, b, H, head_dim] in the compute dtype and head weights [B, b, H] fp32
        (times heads^-0.5)."""
        batch, block, _ = x.shape
        q = self.wq_b(q_resid).view(batch, block, self.n_heads, self.head_dim)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype))
        with fp32_region(q):
            return q, weights.float() * (self.n_heads**-0.5)

    def _visible(self, start: int, block: int, first: int, end: int, device: torch.device) -> Tensor:
        """[b, end - first] bool: whether pool p (first <= p < end) is selectable by query t (start <= t <
        start + b): iff complete and its last token p*kpool+kpool-1 <= t."""
        position = torch.arange(start, start + block, device=device)
        pool_end = torch.arange(first, end, device=device) * self.kpool + self.kpool - 1
        return pool_end[None, :] <= position[:, None]

    @torch.no_grad()
    def select(
        self, x: Tensor, q_resid: Tensor, pool_keys: Tensor | None = None, spans: Spans | None = None
    ) -> Selection:
        """Top pools per query. x [B, S, D], q_resid [B, S, q_lora_rank] (= q_a_layernorm(q_a_proj(x))) of the
        queries; pool_keys [B, P, head_dim]: the window's pooled keys (None: `pool_keys(x)`, x being the whole
        window); spans: the queries' global positions (None: the whole window, 0..S-1).

        A block of queries (within one span) is scored only against the pools its last query can see
        (causality halves the work), but never against fewer than `TOPK_SORT_RATIO * K` pools when more exist:
        torch.topk then ranks every row with the same algorithm whatever its length (partial sort), and
        trailing invisible pools never displace a visible one, so the selection, ties included, equals scoring
        every pool, for any blocking and any split of the queries over ranks. The Triton path selects the
        same pools (module docstring).
        """
        x, q_resid = x.detach(), q_resid.detach()  # (views of grad-requiring inputs confuse module hooks)
        batch, seq_len, _ = x.shape
        spans = whole_window(seq_len) if spans is None else spans
        if sum(length for _, length in spans) != seq_len:
            raise ValueError(f"spans {spans} do not describe the {seq_len} queries given")
        pool_keys = self.pool_keys(x) if pool_keys is None else pool_keys.detach()
        pools = torch.full((batch, seq_len, self.pools_per_query), -1, dtype=torch.int32, device=x.device)
        if self.resolve_backend(x.device) == TRITON:
            block, score = self._kernel_scorer(batch, seq_len, pool_keys)
        else:
            block, score = max(1, self.options.indexer_query_block), self._block_scores
        n_pools = pool_keys.shape[1]
        take = min(self.pools_per_query, n_pools)
        least = min(n_pools, TOPK_SORT_RATIO * take)
        local = 0
        for first_position, length in spans:
            for offset in range(0, length if take else 0, block):
                size = min(block, length - offset)
                start, rows = first_position + offset, slice(local + offset, local + offset + size)
                visible = min((start + size) // self.kpool, n_pools)  # pools the block's last query sees
                if visible == 0:
                    continue
                scored = max(least, visible)
                scores = score(x[:, rows], q_resid[:, rows], pool_keys[:, :scored], start)
                chosen = scores.topk(take, dim=-1).indices
                del scores  # freed before the next block's scores exist
                position = torch.arange(start, start + size, device=x.device)[:, None]
                selectable = chosen * self.kpool + (self.kpool - 1) <= position
                pools[:, rows, :take] = chosen.masked_fill_(~selectable, -1).to(torch.int32)
            local += length
        positions = None if spans == whole_window(seq_len) else span_positions(spans, x.device)
        return Selection(pools=pools, kpool=self.kpool, select_tail=self.select_tail, positions=positions)

    def _kernel_scorer(
        self, batch: int, queries: int, pool_keys: Tensor
    ) -> tuple[int, Callable[[Tensor, Tensor, Tensor, int], Tensor]]:
        """(queries per block, a `_block_scores` twin running the fused kernel) for `select` on the Triton
        path; names the block and operand precision in `route`. With fp8 the pooled keys are quantised once
        here, the queries per block."""
        from genomelm.model.indexer_triton import indexer_scores, tile_config

        block = self.kernel_block(batch, queries, pool_keys.shape[1], tile_config()[0])
        fp8_keys, key_scale = quantize_fp8_rows(pool_keys) if self.fp8 else (pool_keys, None)
        precision = "fp8 e4m3" if self.fp8 else DTYPE_NAMES.get(pool_keys.dtype, str(pool_keys.dtype))
        self.route = f"indexer: triton fused scores, blocks of {block} queries, {precision}"

        def score(x: Tensor, q_resid: Tensor, keys: Tensor, start: int) -> Tensor:
            q, weights = self._block_queries(x, q_resid)
            scale = None
            if key_scale is not None:
                q, query_scale = quantize_fp8_rows(q)
                weights = weights * query_scale
                keys, scale = fp8_keys[:, : keys.shape[1]], key_scale[:, : keys.shape[1]]
            return indexer_scores(
                q.to(keys.dtype), keys, weights, scale, start, self.kpool, self.softmax_scale
            )

        return block, score

    def kl_sum(
        self, x: Tensor, q_resid: Tensor, selection: Selection, pool_mass: Tensor, pool_keys: Tensor
    ) -> tuple[Tensor, Tensor]:
        """DeepSeek-V3.2 indexer training signal, summed: (sum over the queries of KL(attention || indexer) on
        their selected pools, the number of queries with a selected pool); the loss is their ratio over the
        window.

        x [B, n, D], q_resid [B, n, q_lora_rank] and `selection` of the queries (any n of the window);
        pool_keys [B, P, head_dim]: the window's pooled keys with their graph (`pool_keys` of the detached
        window), the only way gradients leave this term: x and q_resid are detached here, so gradients reach
        only the indexer's parameters. pool_mass [B, n, K] fp32: main-attention probability summed over heads
        on each selected pool (the tail excluded), treated as a constant; it is renormalised over the query's
        selected pools. The indexer distribution is the softmax of its index scores over the same pools.
        Token-level KL with every token of a pool carrying the pool's score differs from this by a constant
        only.
        """
        x, q_resid, pool_mass = x.detach(), q_resid.detach(), pool_mass.detach()
        seq_len = x.shape[1]
        block = max(1, self.options.indexer_query_block)
        total = pool_keys.sum() * 0.0
        for start in range(0, seq_len, block):
            end = min(start + block, seq_len)
            pools = selection.pools[:, start:end].long()
            total = total + self.chunk_runner(
                self._block_kl,
                x[:, start:end],
                q_resid[:, start:end],
                pool_keys,
                pools,
                pool_mass[:, start:end],
            )
        return total, (selection.pools >= 0).any(-1).sum()

    def _block_kl(
        self, x: Tensor, q_resid: Tensor, pool_keys: Tensor, pools: Tensor, pool_mass: Tensor
    ) -> Tensor:
        """Sum over the block's queries of KL(normalised pool_mass || softmax of selected pools' index
        scores), in fp32 (fp64 for fp64 inputs)."""
        batch, block, _ = x.shape
        valid = pools >= 0
        safe = pools.clamp(min=0)
        keys = pool_keys[torch.arange(batch, device=x.device)[:, None, None], safe]  # [B, b, K, head_dim]
        q = self.wq_b(q_resid).view(batch, block, self.n_heads, self.head_dim)
        weights = self.weights_proj(x.to(self.weights_proj.weight.dtype))
        wide = at_least_fp32(q.dtype)
        with fp32_region(q):
            scores = F.relu(torch.matmul(q.to(wide), keys.to(wide).transpose(-1, -2)) * self.softmax_scale)
            weighted = weights.to(wide).unsqueeze(-2) * (self.n_heads**-0.5)
            index_scores = torch.matmul(weighted, scores).squeeze(-2)
        index_scores = index_scores.masked_fill(~valid, float("-inf"))
        index_scores = index_scores.masked_fill(
            ~valid.any(-1, keepdim=True), 0.0
        )  # rows with no pool: finite
        log_q = torch.log_softmax(index_scores, dim=-1)
        tiny = torch.finfo(wide).tiny
        target = pool_mass.to(wide).masked_fill(~valid, 0.0)
        target = target / target.sum(-1, keepdim=True).clamp(min=tiny)
        terms = target * (torch.log(target.clamp(min=tiny)) - log_q)
        return terms.masked_fill(~valid, 0.0).sum()

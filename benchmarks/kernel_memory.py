"""Memory of one DSA layer's indexer and sparse attention at one context-parallel rank, torch paths against
the Triton kernels, on fake tensors (no compute, any size on a laptop).

    python benchmarks/kernel_memory.py              # 64k queries per rank of a 1M-token window (cp 16)
    python benchmarks/kernel_memory.py --queries 4096 --window 16384

At GLM-5.3-Flash's widths a zigzag rank's queries (two segments) are scored against the whole window's pooled
keys (`Indexer.select`), then attend over their selected slots of the whole window's latent, forward and
backward (`sparse_latent_attention` vs `dsa_triton.sparse_mla`). Each row is the peak of the bytes the call
allocates, and beside it what every implementation must hold at that peak (the selection; the output, d q_lat,
d latent and its fp32 accumulator), so the difference is the path's own transient. The kernels' custom ops run
their fake implementations (`backends.tracing_kernels`), which allocate what the kernels return; the kernels
allocate nothing else of that size.

The bytes are counted by a dispatch mode over the storages each op returns (`PeakBytes`) rather than torch's
MemTracker, which refuses a module called more than once per pass (the indexer's projections run per block).
"""

from __future__ import annotations

import argparse
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from genomelm.model import ModelConfig, RunOptions
from genomelm.model.backends import tracing_kernels
from genomelm.model.dsa_sparse import query_positions, sparse_latent_attention
from genomelm.model.indexer import Indexer, Selection

GIB = 2**30


class PeakBytes(TorchDispatchMode):
    """The peak of the bytes of the storages the ops inside return (each storage once, until its first tensor
    dies); storages of `exclude`d tensors (the inputs) are not counted."""

    def __init__(self, *exclude: torch.Tensor) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {t.untyped_storage()._cdata: 0 for t in exclude}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in self.sizes:
                key, size = t.untyped_storage()._cdata, t.untyped_storage().nbytes()
                self.sizes[key] = size
                self.live += size
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)


def peak_gib(fn: Callable[[], object], *inputs: torch.Tensor) -> float:
    with PeakBytes(*inputs) as tracker:
        fn()
    return tracker.peak / GIB


@dataclasses.dataclass
class Row:
    part: str
    torch_gib: float
    kernel_gib: float
    held_gib: float  # what any implementation holds at the peak (outputs, gradients, accumulator)

    @property
    def torch_transient(self) -> float:
        return max(self.torch_gib - self.held_gib, 0.0)

    @property
    def kernel_transient(self) -> float:
        return max(self.kernel_gib - self.held_gib, 0.0)


def measure(queries: int, window: int) -> list[Row]:
    """The indexer's select and the sparse attention's forward + backward, both paths (see the module)."""
    config = ModelConfig.preset("glm-5.3-flash")
    half = queries // 2
    spans = ((0, half), (window - half, queries - half))
    scaling = config.qk_head_dim**-0.5
    peaks: dict[bool, tuple[float, float]] = {}
    for kernels in (False, True):
        options = RunOptions(
            indexer_backend="triton" if kernels else "torch", dsa_backend="triton" if kernels else "sparse"
        )
        with tracing_kernels(), FakeTensorMode():
            torch.set_default_dtype(torch.bfloat16)
            try:
                indexer = Indexer(config, options)
            finally:
                torch.set_default_dtype(torch.float32)
            x = torch.empty(1, queries, config.hidden_size, dtype=torch.bfloat16)
            q_resid = torch.empty(1, queries, config.q_lora_rank, dtype=torch.bfloat16)
            keys = torch.empty(1, window // config.index_kpool, config.index_head_dim, dtype=torch.bfloat16)
            chosen: list[Selection] = []
            select_gib = peak_gib(
                lambda: chosen.append(indexer.select(x, q_resid, keys, spans)), x, q_resid, keys
            )
            selection = chosen[0]
            shape = (1, queries, config.num_attention_heads, config.kv_lora_rank)
            q_lat = torch.empty(shape, dtype=torch.bfloat16, requires_grad=True)
            latent = torch.empty(1, window, config.kv_lora_rank, dtype=torch.bfloat16, requires_grad=True)
            grad = torch.empty_like(q_lat)

            def attend() -> None:
                if kernels:
                    from genomelm.model.dsa_triton import sparse_mla

                    positions = query_positions(selection, q_lat.device)
                    pools, kpool, tail = selection.pools, selection.kpool, selection.select_tail
                    out = sparse_mla(q_lat, latent, pools, positions, kpool, tail, scaling, False, False)[0]
                else:
                    out = sparse_latent_attention(q_lat, latent, selection, scaling, 128, False)[0]
                out.backward(grad)

            attend_gib = peak_gib(attend, q_lat, latent, grad)
        peaks[kernels] = (select_gib, attend_gib)
    selection_gib = queries * config.index_topk // config.index_kpool * 4 / GIB  # pools int32
    lat = queries * config.num_attention_heads * config.kv_lora_rank * 2 / GIB  # out, d q_lat (bf16 each)
    held = 2 * lat + window * config.kv_lora_rank * (2 + 4) / GIB  # + d latent bf16 and its fp32 accumulator
    return [
        Row("indexer select", peaks[False][0], peaks[True][0], selection_gib),
        Row("sparse attention fwd + bwd", peaks[False][1], peaks[True][1], held),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--queries", type=int, default=65536, help="queries of one rank (default: 1M / cp 16)"
    )
    parser.add_argument("--window", type=int, default=1 << 20, help="tokens of the whole window")
    args = parser.parse_args(argv)
    rows = measure(args.queries, args.window)
    print(f"{args.queries:,} queries of a {args.window:,}-token window, GLM-5.3-Flash widths (GiB):")
    print(
        "| part | torch peak | kernel peak | held by any path | torch transient | kernel transient | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = r.kernel_transient / r.torch_transient if r.torch_transient else float("nan")
        print(
            f"| {r.part} | {r.torch_gib:.2f} | {r.kernel_gib:.2f} | {r.held_gib:.2f} "
            f"| {r.torch_transient:.2f} | {r.kernel_transient:.2f} | {ratio:.1%} |"
        )
    torch_total = sum(r.torch_transient for r in rows)
    kernel_total = sum(r.kernel_transient for r in rows)
    print(
        f"indexer + sparse attention transient: {torch_total:.2f} -> {kernel_total:.2f} GiB "
        f"({kernel_total / torch_total:.1%} of the torch paths')"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a parallel training step moves between ranks, beside the layers' own exchanges.

Context parallel (`ContextRun`):

Every rank of a context-parallel group reads the same window (the same data order), keeps its shard of the
tokens, labels and loss weights (`ContextRun.shard`), and runs the model on them. The loss is the global
token-weighted mean: each rank divides its weighted sum by the weight summed over the group
(`ContextRun.global_sum`), so the ranks' losses add up to the window's loss and no term is scaled by the
group size. After the backward pass the parameter gradients (each rank's share) are summed over the group in
one packed all-reduce (`ContextRun.sum_gradients`), so every rank applies the same update and the replicas
stay equal.

The whole mesh (`ParallelRun`: dp x cp ranks, ep borrowing them): every dp rank reads its own windows of each
optimizer step (micro-batch g of the step goes to dp rank g % dp), each rank's loss is divided by the step's
window count (grad_accum * dp), so the gradients summed over all ranks equal one process's with grad_accum *
dp windows. With `fsdp` (FSDP2 `fully_shard`: every decoder layer and the root over all ranks, the routed
experts of an expert-parallel run over the ranks holding the same experts) the sum is FSDP's reduce-scatter
with a divide factor of 1; without it, one packed all-reduce per group (`reduce_gradients`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .context import apply_context_parallel
from .exchange import all_gather_slots
from .expert import apply_expert_parallel, expert_parallel_parameters, received_tokens
from .fsdp import shard_model
from .layout import ZIGZAG, ContextLayout, segments_of
from .mesh import Mesh, ParallelDims
from .placement import Placement


@dataclass(frozen=True)
class ContextRun:
    """This process's place in its context-parallel group (`process_group`; every process when None)."""

    cp: int
    rank: int
    kind: str = ZIGZAG
    process_group: dist.ProcessGroup | None = None  # None: the default group (every process)

    @classmethod
    def from_environment(cls, kind: str = ZIGZAG) -> ContextRun | None:
        """The group set up by `genomelm.parallel.launch`, or None in a single process."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        return cls(dist.get_world_size(), dist.get_rank(), kind)

    @property
    def group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def is_output_rank(self) -> bool:
        return self.rank == 0

    def layout(self, seq_len: int, kda_chunk: int, kpool: int) -> ContextLayout:
        return ContextLayout(seq_len, self.cp, self.rank, self.kind, kda_chunk=kda_chunk, kpool=kpool)

    def shard(self, layout: ContextLayout, *rows: Tensor) -> list[Tensor]:
        """This rank's tokens of each [B, S, ...] row tensor (labels already made over the whole window)."""
        return [layout.shard(row, dim=1) for row in rows]

    def global_sum(self, value: Tensor) -> Tensor:
        """value summed over the group (no graph), the same on every rank."""
        total = value.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def sum_gradients(self, model: nn.Module) -> None:
        """Sum every parameter's gradient over the group, in one packed all-reduce per dtype."""
        sum_packed([p.grad for p in model.parameters() if p.grad is not None], self.group)


def sum_packed(tensors: list[Tensor], group: dist.ProcessGroup) -> None:
    """Sum tensors over `group` in place, one packed all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for tensor in same:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


@dataclass
class ParallelRun:
    """This rank's place in a dp x cp (x ep) run and what a training step moves across the mesh.

    `context` is the context-parallel part (None at cp=1); `fsdp` says whether `prepare` sharded the model;
    `device`: where this rank's collectives run (its GPU under NCCL, which takes CUDA tensors only; the CPU
    under gloo), whatever device a parameter's shard lives on (FSDP2's CPU offload keeps them on the host).
    """

    mesh: Mesh
    context: ContextRun | None
    fsdp: bool
    device: torch.device = torch.device("cpu")

    @classmethod
    def from_environment(
        cls, dims: ParallelDims, kind: str, fsdp: bool, device_type: str
    ) -> ParallelRun | None:
        """The mesh of the processes a launcher started (None in a single process)."""
        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
            return None
        mesh = Mesh.build(dims, device_type)
        context = None
        if dims.cp > 1:
            context = ContextRun(dims.cp, mesh.coordinates["cp"], kind, mesh.cp_group)
        device = torch.device(device_type)
        if device_type == "cuda":
            device = torch.device(device_type, torch.cuda.current_device())
        return cls(mesh, context, fsdp, device)

    @property
    def dims(self) -> ParallelDims:
        return self.mesh.dims

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def is_output_rank(self) -> bool:
        return self.mesh.rank == 0

    def prepare(
        self,
        model: nn.Module,
        param_dtype: torch.dtype | None,
        capacity_factor: float,
        optimizer_offload: bool = False,
        overlap: bool = True,
        placements: Mapping[str, Placement] | None = None,
        prefetch: int = 0,
        reduce_dtype: torch.dtype | None = None,
    ) -> None:
        """Split `model` over the mesh in place: context parallel over the cp group, expert parallel over the
        ep group, then (with `fsdp`) FSDP2. `param_dtype`: the dtype FSDP gathers parameters in (bf16 runs);
        None keeps the parameters' own dtype. `optimizer_offload`: FSDP2's CPU offload (sharded fp32
        parameters, gradients and AdamW state in pinned host memory; the step runs on the CPU). `overlap`:
        the expert exchanges started ahead; `placements`: where the experts of the `Experts` modules they
        name live (`apply_expert_parallel`). With FSDP: `prefetch`, the layers whose all-gathers each layer
        issues ahead; `reduce_dtype`, what the gradients are reduce-scattered in (None: fp32 under a
        `param_dtype`) (`shard_model`)."""
        if self.context is not None:
            apply_context_parallel(model, self.context.group, self.context.kind)
        if self.dims.ep > 1:
            apply_expert_parallel(model, self.mesh.ep_group, capacity_factor, overlap, placements)
        if optimizer_offload and not self.fsdp:
            raise ValueError("optimizer_offload=true needs fsdp=true (FSDP2 keeps the host copy)")
        if self.fsdp:
            shard_model(model, self.mesh, param_dtype, optimizer_offload, prefetch, reduce_dtype)

    def reduce_gradients(self, model: nn.Module) -> None:
        """Without FSDP: sum the gradients over every rank holding the same parameter (one packed all-reduce
        per group). With FSDP the backward's reduce-scatter already did."""
        if self.fsdp:
            return
        experts = set(expert_parallel_parameters(model).values())
        shared = [p.grad for p in model.parameters() if p.grad is not None and p not in experts]
        sum_packed(shared, dist.group.WORLD)
        local = [p.grad for p in experts if p.grad is not None]
        if self.dims.edp > 1:
            sum_packed(local, self.mesh.edp_mesh.get_group())

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> Tensor:
        """Clip the gradients to a global L2 norm of `max_norm`; returns the norm before clipping (a 0-dim
        fp64 tensor on `device`: reading it is the caller's one host sync).

        Written here because torch's `clip_grad_norm_` cannot mix DTensors of two meshes (the experts live on
        their own): each rank sums the squares of what it alone holds of each gradient, summed over ranks.
        """
        experts = set(expert_parallel_parameters(model).values())
        grads = []
        squares = None
        for param in model.parameters():
            if param.grad is None:
                continue
            grad = param.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if squares is None:
                squares = torch.zeros(2, dtype=torch.float64, device=local.device)
            grads.append(local)
            squares[1 if param in experts else 0] += local.double().pow(2).sum()
        if squares is None:  # no gradient here (a rank whose parameters all went unused): zeros all the same
            squares = torch.zeros(2, dtype=torch.float64, device=self.device)
        squares = squares.to(
            self.device
        )  # host-offloaded gradients: their sums go to the collective's device
        if self.fsdp:  # every element lives on exactly one rank
            dist.all_reduce(squares)
            total = squares.sum().sqrt()
        else:  # shared gradients are equal on every rank; an expert's on its EP group's ranks alike
            expert_sq = squares[1:].clone()
            dist.all_reduce(expert_sq, group=self.mesh.ep_group)
            total = (squares[0] + expert_sq[0]).sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # a factor of 1 leaves a gradient exactly as it is
        for local in grads:
            local.mul_(scale.to(local.device))
        return total

    def mean_over_data(self, values: Tensor) -> Tensor:
        """The mean over the dp groups of per-rank values (equal within a cp group): a new tensor on their
        device, no host sync."""
        total = values.detach().clone()
        if self.dims.dp > 1:
            dist.all_reduce(total, group=self.mesh.dp_group)
        return total / self.dims.dp

    def gather_over_data(self, items: list) -> list:
        """Each dp rank's list, concatenated in dp-rank order (for the metrics' window lists)."""
        if self.dims.dp == 1:
            return items
        parts: list = [None] * self.dims.dp
        dist.all_gather_object(parts, items, group=self.mesh.dp_group)
        return [item for part in parts for item in part]

    def expert_rows_by_rank(self, model: nn.Module) -> list[int] | None:
        """(token, expert) rows each rank's experts computed since the last call, all MoE layers, in rank
        order (None without expert parallelism). Real DNA routes unevenly: the busiest rank is the one to
        watch."""
        if self.dims.ep == 1:
            return None
        rows = float(sum(received_tokens(model).values()))
        mine = torch.tensor([rows], dtype=torch.float64, device=self.device)
        everyone = all_gather_slots(mine, dist.group.WORLD)
        return [int(part) for part in everyone.tolist()]

    def sum_counts(self, counts: dict[int, Tensor]) -> dict[int, Tensor]:
        """Per-layer expert token counts (each rank's own tokens) summed over every rank."""
        if not counts:
            return counts
        layers = sorted(counts)
        flat = torch.cat([counts[layer].reshape(-1) for layer in layers]).to(torch.float64)
        dist.all_reduce(flat)
        return dict(zip(layers, flat.split([counts[layer].numel() for layer in layers]), strict=True))


class ContextParallelScorer(nn.Module):
    """A model under context parallelism seen as one that scores whole windows, for evaluation.

    `loss(input_ids [B, S], labels [B, S], reduction="none")` shards the window, runs this rank's part and
    all-gathers the per-token losses back into window order: [B, S] fp32, the same on every rank.
    `hidden_states(input_ids [B, S], upto_layer)` gathers the per-token hidden states the same way, onto
    rank 0 of the group only.
    """

    def __init__(self, model: nn.Module, context: ContextRun) -> None:
        super().__init__()
        self.model = model
        self.context = context

    def loss(self, input_ids: Tensor, labels: Tensor, reduction: str = "none") -> Tensor:
        if reduction != "none":
            raise ValueError("ContextParallelScorer gives per-token losses only (reduction='none')")
        model = self.model
        seq_len = input_ids.shape[1]
        layout = self.context.layout(seq_len, model.options.kda_chunk_size, model.config.index_kpool)
        ids, local_labels = self.context.shard(layout, input_ids, labels)
        nll = model(ids, local_labels, reduction="none").contiguous()
        parts = [torch.empty_like(nll) for _ in range(self.context.cp)]
        dist.all_gather(parts, nll, group=self.context.group)
        return layout.restore(torch.cat(parts, dim=1), dim=1)

    def hidden_states(self, input_ids: Tensor, upto_layer: int | None = None) -> Tensor | None:
        """The whole window's `GlmForCausalLM.hidden_states(input_ids, upto_layer=upto_layer)`: [B, S, D] fp32
        in window order on rank 0 of the group, None on the other ranks (each runs its shard and sends it).

        Gathered onto one rank rather than all-gathered, because a window's states are large (S x D x 4
        bytes: 16 GiB at 1M tokens and the full model's D = 4096): only rank 0 holds them, received in place
        in window order (one gather per local segment straight into its slice, no reordering copy); every
        other rank holds its S/cp tokens' states only. Under FSDP2 the wrapped model's `hidden_states` must be
        registered as a forward method (`torch.distributed.fsdp.register_fsdp_forward_method`), so that its
        call gathers the root's parameters as `forward` does.
        """
        model = self.model
        context = self.context
        seq_len = input_ids.shape[1]
        layout = context.layout(seq_len, model.options.kda_chunk_size, model.config.index_kpool)
        (ids,) = context.shard(layout, input_ids)
        local = model.hidden_states(ids, upto_layer=upto_layer)  # [B, S/cp, D], this rank's segments in order
        width = layout.segment_len
        # position-major [S, B, D]: every segment's slice is contiguous for any B, as the gather needs
        whole = local.new_empty(seq_len, local.shape[0], local.shape[2]) if context.rank == 0 else None
        for j in range(len(layout.segments)):  # every rank holds as many segments (1 or 2)
            part = local[:, j * width : (j + 1) * width].transpose(0, 1).contiguous()
            slices = None
            if whole is not None:
                starts = [segments_of(r, context.cp, context.kind)[j] * width for r in range(context.cp)]
                slices = [whole[start : start + width] for start in starts]
            dist.gather(part, slices, group=context.group, group_dst=0)
        return None if whole is None else whole.transpose(0, 1)

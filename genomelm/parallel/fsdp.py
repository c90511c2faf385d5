"""FSDP2 over the training mesh: one FSDP unit per decoder layer however often the layer calls its parts, and
the parameters the model declares fp32 gathered in fp32.

`shard_model` applies `fully_shard` to every decoder layer, then to the root (embedding, final norm, head).
A layer's unit holds up to three parameter groups. FSDP all-gathers each group in one collective as the
layer's forward starts and again as its backward starts (a per-layer recompute runs inside that backward and
uses the same gather), frees it after each pass, and reduce-scatters its gradients in one collective after
the layer's backward:
- the layer's replicated parameters, sharded over all ranks, gathered in `param_dtype`;
- with expert parallelism, this rank's routed experts (the `Experts` of `apply_expert_parallel`), sharded
  over the ranks holding the same experts (the EDP group), gathered in `param_dtype`;
- with a `param_dtype` other than fp32, the parameters the model declares fp32 (`fp32_declared`: router,
  KDA conv / A_log / dt_bias, mHC base / scale), sharded over all ranks, gathered in fp32, so the fp32
  regions read the fp32 master weights, as in one process under bf16 autocast. Per layer this adds one
  all-gather per pass and one reduce-scatter per backward, of those parameters only (at full size, in fp32:
  0.4 MiB for a KDA + dense layer, 4.5 MiB for DSA + MoE, 4.9 MiB for KDA + MoE, 4.5 of it the router's;
  each rank sends its 1/world share).

Why groups of the layer's unit rather than units of their own: FSDP2 gathers a unit in the unit's forward
pre-hook and registers a reduce-scatter for each call, and the MoE calls its experts and its router once per
chunk of `moe_chunk_tokens` tokens, so a unit on `Experts` gathered them (1.8 GB per layer at full size
and ep=8) once per chunk in the forward and again in the backward. The layer runs once per pass, so its
groups are gathered once per layer and pass whatever the chunk count; only the running layer's groups (and in
the backward those FSDP prefetches for the layer whose backward comes next) are unsharded at a time.

torch 2.13 has two of these pieces only under private names: a per-parameter mesh (`shard_placement_fn`
returning a `ShardPlacementResult`, the return type `fully_shard` documents, defined in `_fsdp_common`),
which makes one parameter group per process group; and a mixed-precision policy per group (FSDP2 takes one
per `fully_shard` call): `_gather_in_fp32` sets the fp32 group's before FSDP's lazy init reads it. As groups
are told apart by process group, the fp32 one has a process group of its own over all ranks.

Prefetch (`prefetch` = n > 0, the `fsdp_prefetch` setting): each layer's forward pre-hook issues the
all-gathers of the next n layers right after its own (the root's, of the first n), and its backward pre-hook
those of the n layers whose backward comes next (FSDP2's `set_modules_to_forward_prefetch` /
`set_modules_to_backward_prefetch`). The point is the MoE forward's host sync (the expert exchange's split
sizes, `genomelm.parallel.expert`): without forward prefetch, layer i+1's gather is issued by layer i+1's
pre-hook, which the host reaches only after layer i's sync has drained the GPU's queue, so the gather runs
alone on the critical path; issued ahead, it is on the all-gather stream before that sync and overlaps
layer i's work. Cost: up to n more layers' gathered parameters at a time. The same gathers, in the same
dtype, of the same values: the numbers do not change (tests/test_parallel_fsdp.py).

Reduction dtype (`reduce_dtype`, the `reduce_dtype` setting): the dtype FSDP2 reduce-scatters the layers'
and the experts' gradients in; bf16 halves the largest stream of bytes between nodes. Each rank's sharded
gradient stays in the parameter's dtype (fp32 master weights): FSDP2 casts the reduced shard back and
accumulates micro-batches there, and the clipping and the optimizer read fp32. The fp32-declared group
(router, KDA decay, mHC) is reduced in fp32 whatever the setting.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from genomelm.model import GlmForCausalLM

from .expert import expert_parallel_parameters
from .mesh import Mesh

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult


def fp32_declared(model: GlmForCausalLM) -> list[str]:
    """Names of the parameters the model declares fp32: those a bf16 build of its config and options keeps in
    fp32 (built on the meta device: no memory; 0.8 s for the full-size model, once torch's meta kernels are
    loaded)."""
    shadow = GlmForCausalLM.from_config(model.config, model.options, torch.bfloat16, "meta")
    return [name for name, param in shadow.named_parameters() if param.dtype == torch.float32]


class _Placement:
    """`shard_placement_fn` of every unit: the mesh (hence the parameter group) each parameter joins; None
    for the unit's own mesh (all ranks) in its `param_dtype`."""

    def __init__(self, model: GlmForCausalLM, mesh: Mesh, param_dtype: torch.dtype | None) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

        self.experts = set(expert_parallel_parameters(model).values())
        self.expert_mesh = FSDPMeshInfo(mesh.edp_mesh, shard_mesh_dim=0) if self.experts else None
        casts = param_dtype is not None and param_dtype != torch.float32
        self.fp32 = {model.get_parameter(name) for name in fp32_declared(model)} if casts else set()
        self.fp32_mesh: FSDPMeshInfo | None = None
        if self.fp32:
            group = dist.new_group(list(range(mesh.dims.world)))  # collective: every rank builds it
            world = DeviceMesh.from_group(group, mesh.world_mesh.device_type, mesh_dim_names=("fp32",))
            self.fp32_mesh = FSDPMeshInfo(world, shard_mesh_dim=0)

    def __call__(self, param: nn.Parameter) -> ShardPlacementResult | None:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

        if param in self.experts:
            return ShardPlacementResult(Shard(0), self.expert_mesh)
        if param in self.fp32:
            return ShardPlacementResult(Shard(0), self.fp32_mesh)
        return None


def _gather_in_fp32(unit: nn.Module, fp32_mesh: FSDPMeshInfo | None) -> None:
    """Give the fp32 parameter group of `unit` (the one on `fp32_mesh`, if any) a policy of its own: gathered
    in the parameters' own dtype (fp32), gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    for group in fully_shard.state(unit)._fsdp_param_groups:
        if fp32_mesh is not None and group.mesh_info is fp32_mesh:
            group.mp_policy = policy
            for param in group.fsdp_params:
                param.mp_policy = policy


def shard_model(
    model: GlmForCausalLM,
    mesh: Mesh,
    param_dtype: torch.dtype | None,
    offload: bool = False,
    prefetch: int = 0,
    reduce_dtype: torch.dtype | None = None,
) -> None:
    """FSDP2 on `model` in place: one unit per decoder layer (its replicated parameters, its experts over the
    EDP group, its fp32-declared parameters in fp32: see the module docstring), then the root. `param_dtype`:
    what FSDP gathers the parameters in (bf16 runs); None keeps their own dtype. `reduce_dtype`: what the
    gradients are reduce-scattered in (None: fp32 when `param_dtype` is set, else the parameters' own).
    Gradients are summed (divide factor 1: the loss is already normalised by the step's global token weight
    and window count). `offload`: FSDP2's CPU offload (GPU runs only). `prefetch`: layers whose all-gathers
    each layer issues ahead, in the forward and the backward (0: FSDP2's default)."""
    from torch.distributed.fsdp import (  # slow import (~0.6 s), for FSDP runs only
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if offload and mesh.world_mesh.device_type != "cuda":
        raise ValueError(
            "optimizer_offload=true runs on GPUs only (FSDP2's CPU offload moves state off a GPU)"
        )
    # the loss the root returns is a view, never modified in place (`window_loss` multiplies out of place)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    if prefetch < 0:
        raise ValueError(f"fsdp_prefetch={prefetch}: give the layers gathered ahead (>= 0)")
    if reduce_dtype is None and param_dtype is not None:
        reduce_dtype = torch.float32
    placement = _Placement(model, mesh, param_dtype)
    settings = {
        "mesh": mesh.world_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy(),
        "shard_placement_fn": placement,
    }
    for unit in [*model.layers, model]:
        fully_shard(unit, **settings)
        _gather_in_fp32(unit, placement.fp32_mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if mesh.world_mesh.device_type != "cuda":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum; 1 needs none
    if prefetch:
        _prefetch_ahead(model, prefetch)


def _prefetch_ahead(model: GlmForCausalLM, ahead: int) -> None:
    """Each unit issues the all-gathers of the `ahead` units that run after it, in the forward (the root: the
    first layers) and in the backward (the root, whose backward runs first: the last layers)."""
    layers = list(model.layers)
    model.set_modules_to_forward_prefetch(layers[:ahead])
    model.set_modules_to_backward_prefetch(layers[::-1][:ahead])
    for index, layer in enumerate(layers):
        following = layers[index + 1 : index + 1 + ahead]
        preceding = layers[max(index - ahead, 0) : index][::-1]
        if following:
            layer.set_modules_to_forward_prefetch(following)
        if preceding:
            layer.set_modules_to_backward_prefetch(preceding)

"""One device mesh for a run: dp x cp ranks, expert parallelism borrowing them (as torchtitan's ParallelDims).

Rank r sits at (dp_rank, cp_rank) = divmod(r, cp): the ranks of one context-parallel group are neighbours (one
node's fast links carry the per-layer exchanges). Expert parallelism groups `ep` consecutive ranks: rank r
holds the experts of expert-parallel rank r % ep, and the dp*cp/ep ranks holding the same experts (every ep-th
rank) form its expert-data-parallel group, over which FSDP shards those experts and sums their gradients.

    world = dp * cp;   ep divides world;   the routed expert count divides by ep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class ParallelDims:
    """How many ranks split the data (dp), one window (cp), and the routed experts (ep)."""

    dp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts (FSDP shards the experts over them)."""
        return self.world // self.ep

    def check(self, num_experts: int | None = None) -> None:
        """Raise ValueError naming the reason when the combination cannot run (before any process starts)."""
        for name, value in (("dp", self.dp), ("cp", self.cp), ("ep", self.ep)):
            if value < 1:
                raise ValueError(f"{name}={value}: give a number of ranks >= 1")
        if self.world % self.ep:
            works = [n for n in range(1, self.world + 1) if self.world % n == 0]
            raise ValueError(
                f"ep={self.ep} does not divide dp*cp={self.world} (expert parallelism borrows "
                f"the dp x cp ranks); ep can be one of {works}"
            )
        if num_experts and num_experts % self.ep:
            works = [n for n in range(1, self.world + 1) if self.world % n == 0 and num_experts % n == 0]
            raise ValueError(
                f"ep={self.ep} does not divide the model's {num_experts} routed experts; with "
                f"dp*cp={self.world} ep can be one of {works}"
            )

    def coordinates(self, rank: int) -> dict[str, int]:
        """Rank r's place: dp and cp rank, expert-parallel rank, and index among its EP group's replicas."""
        dp_rank, cp_rank = divmod(rank, self.cp)
        return {"dp": dp_rank, "cp": cp_rank, "ep": rank % self.ep, "edp": rank // self.ep}


@dataclass
class Mesh:
    """The process groups and device meshes of this rank (built collectively: every rank calls `build`)."""

    dims: ParallelDims
    rank: int
    world_mesh: DeviceMesh  # 1-D over all ranks: FSDP of every non-expert parameter
    expert_mesh: DeviceMesh  # 2-D ("ep", "edp"): the global layout of the routed experts
    dp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str) -> Mesh:
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != dims.world:
            raise ValueError(
                f"dp={dims.dp} x cp={dims.cp} needs {dims.world} processes, this group has {world}"
            )
        dims.check()
        world_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("world",))
        grid = init_device_mesh(device_type, (dims.dp, dims.cp), mesh_dim_names=("dp", "cp"))
        # expert_mesh[e][j] = j * ep + e: EP groups are blocks of consecutive ranks, EDP groups strided
        layout = torch.arange(world).reshape(dims.edp, dims.ep).T.contiguous()
        expert_mesh = DeviceMesh(device_type, layout, mesh_dim_names=("ep", "edp"))
        return cls(dims, rank, world_mesh, expert_mesh, grid.get_group("dp"), grid.get_group("cp"))

    @property
    def coordinates(self) -> dict[str, int]:
        return self.dims.coordinates(self.rank)

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.expert_mesh.get_group("ep")

    @property
    def edp_mesh(self) -> DeviceMesh:
        return self.expert_mesh["edp"]

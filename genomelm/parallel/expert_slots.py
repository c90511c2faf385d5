"""Where the expert exchange sends each (token, expert) pair under a placement by load
(`genomelm.parallel.placement`): the tables that turn global expert ids into slots over the expert-parallel
group, and which expert weights travel to the ranks that hold copies.

A slot over the group is rank x slots per rank + the slot's place on its rank; the exchange sorts and
counts the pairs by it, so its code is the same for any placement. Under the static blocks the slot is the
expert itself and no table is needed (`ExpertSlots.of` gives None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .placement import Placement


@dataclass
class ExpertSlots:
    """One `Experts` module's placement as the exchange reads it, on one rank of the group."""

    # slots per rank whose experts' weights live there (their parameters): E / ep
    owned: int
    # [E, most copies] long: each expert's slots over the group, owner's first (the last repeated)
    table: Tensor
    # [E] long: how many slots hold each expert
    copies: Tensor
    # [n] long: this rank's own experts (rows of its weights) whose weights it sends, by destination rank
    send_rows: Tensor
    # per rank: how many of those go there
    send: list[int]
    # per rank: how many of this rank's copies that rank owns (their weights arrive in that order)
    recv: list[int]

    @classmethod
    def of(cls, placement: Placement, experts: int, ep: int, rank: int) -> ExpertSlots | None:
        """The tables of `placement` for `rank` (ValueError if training cannot run it: `Placement.slots_of`);
        None for the static blocks."""
        slots = placement.slots_of(experts, ep)
        if slots == [[e] for e in range(experts)]:
            return None
        owned = experts // ep
        most = max(len(s) for s in slots)
        table = torch.tensor([s + [s[-1]] * (most - len(s)) for s in slots])
        owner = {e: r for r, held in enumerate(placement.slots) for e in held[:owned]}
        mine = {e: row for row, e in enumerate(placement.slots[rank][:owned])}
        send_rows, send = [], []
        for held in placement.slots:
            rows = [mine[e] for e in held[owned:] if e in mine]
            send_rows += rows
            send.append(len(rows))
        recv = [0] * ep
        for expert in placement.slots[rank][owned:]:
            recv[owner[expert]] += 1
        copies = torch.tensor([len(s) for s in slots])
        return cls(owned, table, copies, torch.tensor(send_rows, dtype=torch.long), send, recv)

    @property
    def has_copies(self) -> bool:
        """Whether ranks hold copies of other ranks' experts (then every rank fetches and sends weights)."""
        return self.table.shape[1] > 1

    def rows_to_send(self, device: torch.device) -> Tensor:
        """`send_rows` on `device` (moved there once)."""
        if self.send_rows.device != device:
            self.send_rows = _on(self.send_rows, device)
        return self.send_rows

    def slot_ids(self, expert_ids: Tensor, spread: int) -> Tensor:
        """expert_ids [T, k] -> the slot computing each pair [T, k]. An expert's pairs are dealt to its copies
        in turn (the j-th pair of the expert, in pair order, to copy (j + `spread`) mod copies; `spread`, the
        source rank, staggers where each rank's remainder goes), so each copy gets its share to within one
        pair per rank: the load model of `Placement.rank_loads`. The same ids give the same slots (a
        recompute routes identically)."""
        if self.table.device != expert_ids.device:  # once per run: a GPU queues it from pinned memory
            self.table, self.copies = (_on(t, expert_ids.device) for t in (self.table, self.copies))
        flat = expert_ids.reshape(-1)
        if not self.has_copies:
            return self.table[flat, 0].view_as(expert_ids)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.table.shape[0])
        first = counts.cumsum(0) - counts  # where each expert's pairs start in `order`
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.numel(), device=flat.device) - first[flat[order]]
        copy = (occurrence + spread) % self.copies[flat]
        return self.table[flat, copy].view_as(expert_ids)


def placements_by_module(model: nn.Module, placements: dict[int, Placement]) -> dict[str, Placement]:
    """MoE layer index -> placement, as `apply_expert_parallel` takes them: by its routed experts' module
    name."""
    names = {id(module): name for name, module in model.named_modules()}
    return {names[id(model.layers[layer].mlp.experts)]: p for layer, p in placements.items()}


def _on(table: Tensor, device: torch.device) -> Tensor:
    """A host table on `device`; to a GPU through pinned memory, so the host does not wait for the copy."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)

"""Where the routed experts live over the expert-parallel ranks: today's static blocks, or a placement chosen
from the measured load per expert, as DeepSeek's EPLB does: the hottest experts get replicas in spare slots,
then every copy is packed onto the rank with the least load so far (longest-processing-time first).

Pure arithmetic over one load vector (tokens routed to each expert, summed over a window of steps); nothing
here moves weights or tokens. Every rank holds the same number of slots, experts / ep plus `spare`. Training
runs a placement whose first experts / ep slots of each rank own their experts (the rank's parameters) and
whose spare slots hold copies fetched from the owners (`Placement.slots_of`, `placement_with_replicas`).
The load model splits an expert's tokens evenly over its copies (training deals them out in turn, to within
one token per source rank: `genomelm.parallel.expert_slots`).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """slots[r]: the experts rank r holds, one per slot (an expert on several ranks is replicated)."""

    slots: tuple[tuple[int, ...], ...]

    @property
    def ep(self) -> int:
        return len(self.slots)

    def copies(self, experts: int) -> list[int]:
        """How many ranks hold each of `experts` experts."""
        counts = [0] * experts
        for rank in self.slots:
            for expert in rank:
                counts[expert] += 1
        return counts

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Tokens each rank computes: each expert's load split evenly over its copies."""
        copies = self.copies(len(load))
        if min(copies) == 0:
            raise ValueError(f"expert {copies.index(0)} has no slot on any rank")
        return [sum(load[e] / copies[e] for e in rank) for rank in self.slots]

    def slots_of(self, experts: int, ep: int) -> list[list[int]]:
        """Each expert's slots over the ranks (rank x slots per rank + its place there), its owner's first,
        after raising ValueError unless training can run this placement: every rank has as many slots, of
        which the first experts / ep own their experts (each expert owned by one rank, where its weights
        live) and the rest hold copies of experts owned elsewhere, ordered by their owner's rank (the order
        the copies' weights arrive in); no rank holds an expert twice."""
        per_rank, owned = len(self.slots[0]), experts // ep
        if self.ep != ep or per_rank < owned or any(len(rank) != per_rank for rank in self.slots):
            shape = [len(rank) for rank in self.slots]
            raise ValueError(
                f"a placement of {experts} experts on ep={ep} needs {owned}+ per rank, not {shape}"
            )
        slots: list[list[int]] = [[] for _ in range(experts)]
        owner = {}
        for rank, held in enumerate(self.slots):
            for place, expert in enumerate(held[:owned]):
                if not 0 <= expert < experts or expert in owner:
                    raise ValueError(f"expert {expert} is owned twice or is not one of the {experts} experts")
                owner[expert] = rank
                slots[expert].append(rank * per_rank + place)
        for rank, held in enumerate(self.slots):
            if len(set(held)) != len(held) or any(e not in owner for e in held):
                raise ValueError(f"rank {rank} holds an expert twice or one no rank owns: {held}")
            copies = held[owned:]
            if [owner[e] for e in copies] != sorted(owner[e] for e in copies):
                raise ValueError(f"rank {rank}'s copies {copies} are not ordered by their owner's rank")
            for place, expert in enumerate(copies, start=owned):
                slots[expert].append(rank * per_rank + place)
        return slots

    def copy_weights(self, experts: int, ep: int) -> int:
        """Experts' weights the busiest rank sends and receives for copies in one layer pass (`slots_of`'s
        layout: the first experts / ep of a rank owned, the rest copies): its own experts' copies elsewhere,
        plus its copies of others'."""
        owned = experts // ep
        owner = {e: r for r, held in enumerate(self.slots) for e in held[:owned]}
        moved = [len(held) - owned for held in self.slots]
        for held in self.slots:
            for expert in held[owned:]:
                moved[owner[expert]] += 1
        return max(moved)

    def busiest_over_mean(self, load: Sequence[float]) -> float:
        """The busiest rank's tokens over the mean rank's: what sets the MoE layers' step time."""
        per_rank = self.rank_loads(load)
        mean = sum(per_rank) / len(per_rank)
        return max(per_rank) / mean if mean > 0 else 1.0


def static_placement(experts: int, ep: int) -> Placement:
    """Today's layout: rank r holds the contiguous block of experts [r E/ep, (r + 1) E/ep)."""
    if experts % ep:
        raise ValueError(f"ep={ep} does not divide the {experts} routed experts")
    per_rank = experts // ep
    return Placement(tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep)))


def replica_counts(load: Sequence[float], slots: int, most: int) -> list[int]:
    """Copies per expert filling `slots` slots: one each, then each spare slot to the expert with the most
    tokens per copy (at most `most` copies: one per rank)."""
    copies = [1] * len(load)
    heap = [(-float(x), e) for e, x in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(slots - len(load)):
        while True:
            _, e = heapq.heappop(heap)
            if copies[e] < most:
                break
        copies[e] += 1
        if copies[e] < most:
            heapq.heappush(heap, (-load[e] / copies[e], e))
    return copies


def balanced_placement(load: Sequence[float], ep: int, spare: int = 0) -> Placement:
    """A placement of `len(load)` experts on `ep` ranks of experts / ep + `spare` slots each that keeps the
    busiest rank's tokens low: replicas by `replica_counts`, then the copies, heaviest first, each onto the
    least-loaded rank with a free slot that does not hold that expert yet. Greedy (EPLB's packing), not an
    optimum: the tests hold it to the lower bounds and to the static blocks."""
    experts = len(load)
    if experts % ep:
        raise ValueError(f"ep={ep} does not divide the {experts} routed experts")
    if spare < 0 or (spare and ep == 1):
        raise ValueError(f"spare={spare}: give 0, or spare slots >= 0 with ep > 1")
    per_rank = experts // ep + spare
    copies = replica_counts(load, per_rank * ep, ep)
    pieces = sorted(
        ((load[e] / copies[e], e) for e in range(experts) for _ in range(copies[e])), reverse=True
    )
    slots: list[list[int]] = [[] for _ in range(ep)]
    totals = [0.0] * ep
    for share, expert in pieces:
        open_ranks = [r for r in range(ep) if len(slots[r]) < per_rank and expert not in slots[r]]
        if not open_ranks:  # the only free slots hold this expert already: take one anyway
            open_ranks = [r for r in range(ep) if len(slots[r]) < per_rank]
        rank = min(open_ranks, key=lambda r: (totals[r], r))
        slots[rank].append(expert)
        totals[rank] += share
    _swap_off_the_busiest(slots, [load[e] / copies[e] for e in range(experts)])
    return Placement(tuple(tuple(sorted(rank)) for rank in slots))


def placement_with_replicas(load: Sequence[float], ep: int, spare: int) -> Placement:
    """What training runs with `spare` copy slots per rank (`Placement.slots_of`): each expert owned by one
    rank, the owners packed by `balanced_placement` on the load per copy (`replica_counts`), then the
    extra copies, heaviest first, each onto the least-loaded rank with a free copy slot that does not hold
    that expert; or, where the copies do not lower the busiest rank's load, the owners alone packed on the
    load (`balanced_placement`). (`balanced_placement` with spare slots packs all copies at once and bounds
    what this gives; a packing whose copies are not parameters of their own is what the ranks can run.)"""
    experts = len(load)
    if spare == 0:
        return balanced_placement(load, ep)
    if spare < 0 or ep == 1 or experts % ep or spare > experts - experts // ep:
        raise ValueError(
            f"spare={spare} copy slots on ep={ep} ranks of {experts} experts: give 0 <= spare <= experts - "
            "experts / ep, ep > 1"
        )
    copies = replica_counts(load, experts + ep * spare, ep)
    share = [load[e] / copies[e] for e in range(experts)]
    owners = balanced_placement(share, ep)
    owner = {e: r for r, held in enumerate(owners.slots) for e in held}
    totals = [sum(share[e] for e in held) for held in owners.slots]
    extra: list[list[int]] = [[] for _ in range(ep)]
    for _, expert in sorted(
        ((share[e], e) for e in range(experts) for _ in range(copies[e] - 1)), reverse=True
    ):
        free = [
            r for r in range(ep) if len(extra[r]) < spare and r != owner[expert] and expert not in extra[r]
        ]
        if not free:  # the free slots are all on ranks holding it: move a copy there to make room elsewhere
            room = _make_room(extra, owner, expert, spare, totals, share)
            if room is None:
                continue  # this copy fits nowhere: its slot goes to another expert below
            free = [room]
        rank = min(free, key=lambda r: (totals[r], r))
        extra[rank].append(expert)
        totals[rank] += share[expert]
    for rank, held in enumerate(extra):  # slots no copy could take: the hottest experts the rank lacks
        while len(held) < spare:
            held.append(
                max((e for e in range(experts) if owner[e] != rank and e not in held), key=load.__getitem__)
            )
    placed = Placement(
        tuple(
            held + tuple(sorted(copies_r, key=lambda e: (owner[e], e)))
            for held, copies_r in zip(owners.slots, extra)
        )
    )
    plain = balanced_placement(load, ep)  # copies cost their weights' exchange: only where they gain
    return placed if placed.busiest_over_mean(load) < plain.busiest_over_mean(load) else plain


def _make_room(
    extra: list[list[int]],
    owner: dict[int, int],
    expert: int,
    spare: int,
    totals: list[float],
    share: list[float],
) -> int | None:
    """A rank that can take a copy of `expert`, made by moving another copy from it to a rank with a free
    slot that `expert` cannot take (that rank holds it); `totals` follow the move. None if no move makes
    room."""
    open_ranks = [r for r in range(len(extra)) if len(extra[r]) < spare]
    for target in open_ranks:
        for rank, held in enumerate(extra):
            if rank == owner[expert] or expert in held:
                continue
            for moved in held:
                if moved not in extra[target] and owner[moved] != target:
                    held.remove(moved)
                    extra[target].append(moved)
                    totals[rank] -= share[moved]
                    totals[target] += share[moved]
                    return rank
    return None


def _swap_off_the_busiest(slots: list[list[int]], share: list[float]) -> None:
    """Improve a packing in place: while swapping one slot of the busiest rank with one of another rank
    (neither then holding an expert twice) lowers the larger of the two ranks' loads, make the best such
    swap. Each swap lowers the busiest rank or the number of ranks tied at its load."""
    totals = [sum(share[e] for e in rank) for rank in slots]
    while True:
        busiest = max(range(len(slots)), key=lambda r: totals[r])
        best, gain = None, 1e-12 * max(totals[busiest], 1e-300)
        for other in range(len(slots)):
            if other == busiest:
                continue
            for i, a in enumerate(slots[busiest]):
                for j, b in enumerate(slots[other]):
                    delta = share[a] - share[b]
                    if delta <= 0 or a in slots[other] or b in slots[busiest]:
                        continue
                    after = max(totals[busiest] - delta, totals[other] + delta)
                    if totals[busiest] - after > gain:
                        best, gain = (other, i, j, delta), totals[busiest] - after
        if best is None:
            return
        other, i, j, delta = best
        slots[busiest][i], slots[other][j] = slots[other][j], slots[busiest][i]
        totals[busiest] -= delta
        totals[other] += delta


def zipf_load(experts: int, exponent: float, seed: int = 0) -> list[float]:
    """A skewed load: the k-th hottest expert gets tokens in proportion to 1 / k**exponent (mean 1), the
    experts in an order drawn from `seed` (where the hot ones sit is chance, as in a trained router)."""
    weights = [1.0 / (k + 1) ** exponent for k in range(experts)]
    order = list(range(experts))
    random.Random(seed).shuffle(order)
    total = sum(weights)
    load = [0.0] * experts
    for k, expert in enumerate(order):
        load[expert] = weights[k] * experts / total
    return load


def fit_zipf(experts: int, ep: int, busiest_over_mean: float, seed: int = 0) -> float:
    """The Zipf exponent whose load gives `busiest_over_mean` under the static blocks at `ep` (bisection:
    the ratio grows with the exponent for a fixed order)."""
    static = static_placement(experts, ep)
    if busiest_over_mean < 1 or busiest_over_mean > ep:
        raise ValueError(f"busiest_over_mean={busiest_over_mean}: give a ratio in [1, ep={ep}]")
    lo, hi = 0.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if static.busiest_over_mean(zipf_load(experts, mid, seed)) < busiest_over_mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def layers_busiest_over_mean(layers: dict[int, list[float]], placements: dict[int, Placement]) -> float:
    """The MoE layers' busiest/mean as a step adds them up: the sum over layers of the busiest rank's tokens
    over the sum of the mean rank's, each layer's load placed by its placement in `placements`."""
    busiest = mean = 0.0
    for layer, load in layers.items():
        per_rank = placements[layer].rank_loads(load)
        busiest, mean = busiest + max(per_rank), mean + sum(per_rank) / len(per_rank)
    return busiest / mean if mean else 1.0

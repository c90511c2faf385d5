"""Context-parallel layout: zigzag and contiguous shards, round trips, labels, refusals."""

from __future__ import annotations

import pytest
import torch

from genomelm.data.vocab import IGNORE_INDEX
from genomelm.parallel import CONTIGUOUS, ZIGZAG, ContextLayout, LayoutError, next_token_labels

KINDS = (ZIGZAG, CONTIGUOUS)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shards_round_trip_and_carry_global_positions(kind: str, cp: int) -> None:
    seq_len = 2 * cp * 64 * 3
    window = torch.randn(2, seq_len, 5)
    layouts = [ContextLayout(seq_len, cp, rank, kind) for rank in range(cp)]
    shards = [layout.shard(window) for layout in layouts]
    for layout, shard in zip(layouts, shards):
        assert shard.shape == (2, seq_len // cp, 5)
        assert torch.equal(shard, window[:, layout.positions()])
    assert torch.equal(layouts[0].restore(torch.cat(shards, dim=1)), window)
    everywhere = torch.cat([layout.positions() for layout in layouts])
    assert torch.equal(everywhere.sort().values, torch.arange(seq_len))
    # another dim, and the gather order helpers
    assert torch.equal(
        layouts[-1].restore(torch.cat([lay.shard(window.mT, dim=2) for lay in layouts], 2), 2), window.mT
    )
    slots = layouts[0].segment_of_slot()
    assert [slots[i] for i in layouts[0].slot_of_segment()] == list(range(layouts[0].num_segments))


def test_zigzag_holds_chunks_r_and_2cp_minus_1_minus_r_and_balances_position_work() -> None:
    cp, seq_len = 4, 4096
    chunk = seq_len // (2 * cp)
    for rank in range(cp):
        layout = ContextLayout(seq_len, cp, rank)
        assert layout.segments == (rank, 2 * cp - 1 - rank)
        expected = torch.cat(
            [
                torch.arange(rank * chunk, (rank + 1) * chunk),
                torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
            ]
        )
        assert torch.equal(layout.positions(), expected)
    # the indexer scores ~t/kpool pools for the query at t: equal sums of positions = equal work
    work = {ContextLayout(seq_len, cp, r).positions().sum().item() for r in range(cp)}
    assert len(work) == 1
    contiguous = [ContextLayout(seq_len, cp, r, CONTIGUOUS).positions().sum().item() for r in range(cp)]
    assert contiguous[-1] > 6 * contiguous[0]


@pytest.mark.parametrize("kind", KINDS)
def test_labels_shift_over_the_whole_window_before_sharding(kind: str) -> None:
    cp, seq_len = 2, 512
    input_ids = torch.randint(1, 5, (2, seq_len), generator=torch.Generator().manual_seed(0))
    for rank in range(cp):
        local = ContextLayout(seq_len, cp, rank, kind).shard_window(input_ids)
        for i, position in enumerate(local.positions.tolist()):  # shard edges included
            expected = (
                input_ids[:, position + 1] if position + 1 < seq_len else torch.full((2,), IGNORE_INDEX)
            )
            assert torch.equal(local.labels[:, i], expected), (rank, i, position)
        assert torch.equal(local.input_ids, input_ids[:, local.positions])
    # the data stage's labels (N and padding already -100) pass through unchanged, sharded like the tokens
    labels = next_token_labels(input_ids)
    labels[:, 7] = IGNORE_INDEX
    local = ContextLayout(seq_len, cp, 1, kind).shard_window(input_ids, labels)
    assert torch.equal(local.labels, labels[:, local.positions])


def test_refuses_windows_that_do_not_split_and_names_what_would() -> None:
    with pytest.raises(LayoutError) as info:
        ContextLayout(1000, 2, 0)
    message = str(info.value)
    assert "1000 tokens" in message and "4 zigzag segments" in message
    assert "KDA chunk (64)" in message and "k-pool (4)" in message
    assert "multiple of 256 tokens (nearest: 768 or 1024)" in message
    with pytest.raises(
        LayoutError, match=r"2 contiguous segments .* KDA chunk \(64\): .*multiple of 128 tokens"
    ):
        ContextLayout(192, 2, 1, CONTIGUOUS)
    with pytest.raises(LayoutError) as info:  # only the k-pool fails
        ContextLayout(256, 2, 0, kda_chunk=16, kpool=128)
    assert "k-pool (128)" in str(info.value) and "KDA chunk" not in str(info.value)
    assert "nearest: 512" in str(info.value)
    with pytest.raises(LayoutError, match="layout must be one of"):
        ContextLayout(256, 2, 0, "striped")
    with pytest.raises(LayoutError, match="rank 2 is outside"):
        ContextLayout(256, 2, 2)
    with pytest.raises(LayoutError, match="expected a whole window of 256 tokens"):
        ContextLayout(256, 2, 0).shard(torch.zeros(1, 128))

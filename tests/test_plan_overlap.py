"""The per-layer event model of a window's streams (`genomelm.plan.overlap`) against hand-worked two-layer
examples."""

import pytest

from genomelm.plan.overlap import LayerWork, simulate


def test_two_layers_without_side_work_take_their_compute():
    layers = [LayerWork(forward=1.0, recompute=1.0, backward=2.0)] * 2
    timeline = simulate(layers, before=0.5, between=0.25)
    assert timeline.window_s == pytest.approx(0.5 + 2 * 4.0 + 0.25) and timeline.exposed_s == pytest.approx(0)


def test_forward_gathers_hide_only_behind_the_moe_work_after_the_host_sync():
    # layer 0 (MoE, syncs): forward 4 s of which its MoE's last 1 s after the sync; each gather 2 s.
    # forward: gather 0 [0, 2], layer 0 [2, 6], the host released at 5: gather 1 [5, 7], layer 1 [7, 11]
    # (1 s waited). between: [11, 12]. backward: gather 1 at 12 [12, 14] (2 s waited), layer 1 [14, 17],
    # gather 0 issued at 14 [14, 16] hidden, reduce-scatter 1 [17, 18]; layer 0 [17, 20], reduce-scatter 0
    # [20, 21]: 1 s after the compute. Total 21 = 15 of compute + 3 + 2 + 1 waited.
    moe = LayerWork(forward=4.0, recompute=1.0, backward=2.0, tail=1.0, syncs=True, gather=2.0, reduce=1.0)
    dense = LayerWork(forward=4.0, recompute=1.0, backward=2.0, gather=2.0, reduce=1.0)
    timeline = simulate([moe, dense], between=1.0)
    assert timeline.window_s == pytest.approx(21.0)
    assert timeline.compute_s == pytest.approx(15.0)
    assert timeline.exposed["forward all-gathers"] == pytest.approx(2.0 + 1.0)
    assert timeline.exposed["backward all-gathers"] == pytest.approx(2.0)
    assert timeline.exposed["reduce-scatters after the backward"] == pytest.approx(1.0)
    assert sum(timeline.exposed.values()) == pytest.approx(timeline.exposed_s)
    # prefetching one layer ahead in the forward: gather 1 right behind gather 0 [2, 4], hidden
    ahead = simulate([moe, dense], between=1.0, forward_prefetch=1)
    assert ahead.window_s == pytest.approx(20.0) and ahead.exposed["forward all-gathers"] == pytest.approx(
        2.0
    )


def test_inputs_back_from_the_host_wait_and_collectives_slow_the_compute():
    # backward: the host one layer ahead; layer 1's input [0, 3] over PCIe (3 s waited), layer 1 [3, 5];
    # layer 0's input from layer 1's start at 3 [3, 6]: 1 s waited, layer 0 [6, 8].
    layers = [LayerWork(forward=0.0, recompute=1.0, backward=1.0, host_in=3.0)] * 2
    timeline = simulate(layers)
    assert timeline.window_s == pytest.approx(8.0)
    assert timeline.exposed["inputs back from the host"] == pytest.approx(4.0)
    # a 1 s reduce-scatter after each layer's backward: the first beside layer 0's 2 s compute (10% slower)
    reduce = [LayerWork(forward=0.0, recompute=1.0, backward=1.0, reduce=1.0)] * 2
    slowed = simulate(reduce, comm_sm_share=0.1)
    assert slowed.window_s == pytest.approx(4.0 + 1.0 + 0.1)
    assert slowed.exposed["compute slowed beside collectives"] == pytest.approx(0.1)
    # copy-outs on the compute stream, once per pass
    copies = simulate([LayerWork(forward=1.0, recompute=1.0, backward=1.0, copy_out=0.5)] * 2)
    assert copies.window_s == pytest.approx(6.0 + 4 * 0.5)


def test_backward_prefetch_of_two_layers_hides_a_long_gather():
    # three layers, each forward 1 s, recompute + backward 2 s; layer 0's gather 3 s, the others' 1 s.
    # forward (no sync: the host issues every gather at 0): gathers [0, 3] [3, 4] [4, 5], layers [3, 4]
    # [4, 5] [5, 6] (3 s waited). backward, one ahead: gather 2 [6, 7], layer 2 [7, 9] (1 s waited), gather 1
    # at 7 [7, 8], layer 1 [9, 11], gather 0 at 9 [9, 12], layer 0 [12, 14] (1 s waited): 14 s.
    # two ahead (fsdp_prefetch=2): gathers 2 and 1 at 6 [6, 7] [7, 8], layer 2 [7, 9], gather 0 at 7 [8, 11],
    # layer 1 [9, 11], layer 0 [11, 13]: 13 s, the long gather hidden behind layers 2 and 1.
    first = LayerWork(forward=1.0, recompute=1.0, backward=1.0, gather=3.0)
    rest = LayerWork(forward=1.0, recompute=1.0, backward=1.0, gather=1.0)
    one = simulate([first, rest, rest])
    two = simulate([first, rest, rest], forward_prefetch=2)
    assert one.window_s == pytest.approx(14.0) and two.window_s == pytest.approx(13.0)
    assert one.exposed["forward all-gathers"] == two.exposed["forward all-gathers"] == pytest.approx(3.0)
    assert one.exposed["backward all-gathers"] == pytest.approx(2.0)
    assert two.exposed["backward all-gathers"] == pytest.approx(1.0)
    assert one.compute_s == two.compute_s == pytest.approx(9.0)
    # one ahead is FSDP2's default backward prefetch: fsdp_prefetch=1 changes the forward alone
    assert simulate([first, rest, rest], forward_prefetch=1).window_s == pytest.approx(14.0)

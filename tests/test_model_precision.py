"""bf16 mixed precision on the CPU (CPU autocast stands in for the GPU's): the train step runs, and its
numbers stay within bf16 rounding of fp32 and of transformers' own bf16 run, on real fly DNA.

Tolerances. bf16 keeps 8 significant bits, so one rounding moves a value by at most U = 2^-8 (0.39%) relative.
A log-probability is a difference of logits of order one, each the end of a long chain of rounded matmuls, so
we allow a mean error of 4U (0.016 nats). The largest single-token error is dominated by discrete choices that
bf16 can flip (an expert or an indexer pool whose score ties with the next within rounding): for it we require
no worse than 1.5x what transformers' own implementation shows between its bf16 and fp32 runs on the same
weights and tokens, plus U. Gradients are compared by cosine similarity per parameter (>= 0.99).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from model_helpers import oracle_config

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.train.memory import LayerRunner, set_chunk_recompute

ROOT = Path(__file__).resolve().parents[1]
U = 2.0**-8
CODES = {"A": 1, "C": 2, "G": 3, "T": 4, "N": 5}
OPTIONS = RunOptions(
    attention_query_block=64, indexer_query_block=64, moe_chunk_tokens=300, loss_chunk_tokens=200
)


def fly_tokens(length: int, start: int = 100_000) -> torch.Tensor:
    """[1, length] token ids of real D. melanogaster chr4 bases (uppercased), from the bundled genome."""
    import gzip

    from Bio import SeqIO

    with gzip.open(ROOT / "data" / "dmel_chr4.fa.gz", "rt") as handle:
        bases = str(next(SeqIO.parse(handle, "fasta")).seq[start : start + length]).upper()
    return torch.tensor([[CODES.get(b, 5) for b in bases]])


def next_base_labels(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def preset_model(name: str, **changes: object) -> GlmForCausalLM:
    """A preset with its own initialisation (seeded), optionally with config changes."""
    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig.preset(name), **changes)
    return GlmForCausalLM(config, OPTIONS)


def step(model: GlmForCausalLM, ids: torch.Tensor, bf16: bool) -> tuple[float, torch.Tensor, dict]:
    """Loss, token log-probabilities and gradients of one train step through the trainer's layer runner
    (recompute, offload, kept selections)."""
    runner = LayerRunner(recompute=True, offload=True, keep_selection=True)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(ids, next_base_labels(ids), layer_runner=runner)
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logprobs = model.token_logprobs(ids)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), logprobs, grads


def transformers_logprobs(model: GlmForCausalLM, ids: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The oracle's log-probabilities on the same weights, under the same autocast."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    ref = Glm5NextTextModel(oracle_config(model.config)).float().eval()
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        hidden = ref(input_ids=ids, use_cache=False).last_hidden_state
        logits = (hidden[:, :-1] @ model.lm_head.weight.T).float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]


def cosines(a: dict, b: dict) -> dict[str, float]:
    return {
        n: float(
            torch.nn.functional.cosine_similarity(a[n].flatten().double(), b[n].flatten().double(), dim=0)
        )
        for n in b
    }


@pytest.mark.parametrize(
    "preset,length,changes",
    [
        ("tiny", 256, {}),  # 256 tokens over index_topk 16: the sparse selection matters
        # every block type at the `small` widths; index_topk covers the window, so no indexer near-tie can
        # flip
        ("small", 1024, {"index_topk": 1024}),
    ],
)
def test_bf16_step_matches_fp32_and_transformers(preset: str, length: int, changes: dict) -> None:
    model = preset_model(preset, **changes)
    ids = fly_tokens(length)
    loss32, logp32, grads32 = step(model, ids, bf16=False)
    loss16, logp16, grads16 = step(model, ids, bf16=True)
    assert np.isfinite(loss16) and all(torch.isfinite(g).all() for g in grads16.values())
    assert grads16.keys() == grads32.keys()
    assert abs(loss16 - loss32) <= 4 * U * loss32

    ref32, ref16 = transformers_logprobs(model, ids, False), transformers_logprobs(model, ids, True)
    torch.testing.assert_close(logp32, ref32, atol=1e-4, rtol=0)  # fp32: exact against the oracle
    reference_spread = float((ref16 - ref32).abs().max())
    for other in (logp32, ref16):
        error = (logp16 - other).abs()
        assert float(error.mean()) <= 4 * U, float(error.mean())
        assert float(error.max()) <= 1.5 * reference_spread + U, (float(error.max()), reference_spread)

    similarity = cosines(grads16, grads32)
    # the mHC `base` vectors get a sum over tokens of per-token terms that nearly cancel at this
    # initialisation; bf16 noise is then a visible share of it (measured 0.989 on `small`)
    low = {n: c for n, c in similarity.items() if c < (0.95 if n.endswith("hc.base") else 0.99)}
    assert not low, low


def test_bf16_train_step_with_chunk_recompute_is_finite_and_equal() -> None:
    """The per-chunk recompute policy changes memory, not numbers, under bf16 too."""
    model = preset_model("tiny")
    ids = fly_tokens(256, start=200_000)
    loss_a, _, grads_a = step(model, ids, bf16=True)
    set_chunk_recompute(model, True)
    loss_b, _, grads_b = step(model, ids, bf16=True)
    assert loss_a == loss_b
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-2, atol=1e-6, msg=name)


def test_fp32_regions_hold_under_autocast() -> None:
    """Router, mHC mixing and combine, and the loss keep fp32 math when the caller turns bf16 autocast on."""
    from genomelm.model.loss import token_nll
    from genomelm.model.mhc import hc_combine

    model = preset_model("tiny")
    x = torch.randn(50, model.config.hidden_size)
    streams = torch.randn(1, 50, model.config.hc_mult, model.config.hidden_size)
    moe = model.layers[1].mlp
    with torch.no_grad():
        ids32, weights32 = moe.gate(x)
        post32, comb32, block32 = model.layers[1].attn_hc(streams)
        combined32 = hc_combine(post32, comb32, block32, streams)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ids16, weights16 = moe.gate(x)
            post16, comb16, block16 = model.layers[1].attn_hc(streams)
            combined16 = hc_combine(post16, comb16, block16, streams)
            nll16 = token_nll(x[None], model.lm_head.weight, torch.randint(1, 5, (1, 50)), 7)
    assert torch.equal(ids16, ids32) and weights16.dtype == torch.float32
    torch.testing.assert_close(weights16, weights32, rtol=0, atol=0)
    for a, b in ((post16, post32), (comb16, comb32), (block16, block32), (combined16, combined32)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert nll16.dtype == torch.float32


def test_loss_backward_uses_the_forward_precision() -> None:
    """Under autocast the loss's logits are bf16 in forward and backward alike: its gradient equals autograd's
    through an explicit bf16 logits matmul with an fp32 softmax (one chunk, so both sum the same products)."""
    from genomelm.model.loss import token_nll

    torch.manual_seed(1)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(8, 16, requires_grad=True)
    labels = torch.randint(0, 8, (40,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        token_nll(hidden, weight, labels, chunk_tokens=64).sum().backward()
    expected_hidden = hidden.detach().clone().requires_grad_(True)
    expected_weight = weight.detach().clone().requires_grad_(True)
    logits = (expected_hidden.bfloat16() @ expected_weight.bfloat16().T).float()
    torch.nn.functional.cross_entropy(logits, labels, reduction="sum").backward()
    torch.testing.assert_close(hidden.grad, expected_hidden.grad, rtol=2 * U, atol=1e-3)
    torch.testing.assert_close(weight.grad, expected_weight.grad, rtol=2 * U, atol=1e-3)


def test_eval_buckets_in_bf16_match_fp32(tmp_path) -> None:
    from genomelm.data.vocab import BUILTIN
    from genomelm.data.windows import Window
    from genomelm.eval.buckets import bucketed_loss
    from genomelm.run.scoring import score_windows

    model = preset_model("tiny")
    windows = []
    for start in (300_000, 310_000):
        ids = fly_tokens(512, start=start)[0]
        windows.append(
            Window(
                "fly",
                len(windows),
                "chr4",
                start,
                start + 512,
                ids,
                torch.zeros(512, dtype=torch.bool),
                BUILTIN,
            )
        )
    rows = {}
    for precision in ("fp32", "bf16"):
        scores = score_windows(model, windows, bucket=128, context_cut=True, precision=precision)
        rows[precision] = bucketed_loss(scores.loss, scores.valid, scores.softmask, 128)
    for fp32, bf16 in zip(rows["fp32"], rows["bf16"], strict=True):
        assert abs(bf16["loss"] - fp32["loss"]) <= 4 * U * fp32["loss"], (bf16, fp32)

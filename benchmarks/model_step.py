"""Forward + backward throughput and peak memory of genomelm's model (`small` preset) on the CPU.

Cases: genomelm at 4k, 16k and 64k tokens (one row, batch 1) and the transformers reference
(`Glm5NextTextModel` + lm_head, same config and weights) at 4k. Every case runs in a fresh subprocess, so its
peak RSS (`ru_maxrss`) is its own. genomelm's layers run through the trainer's `LayerRunner` (activation
recompute per layer, DSA selections kept for the recompute, no offload: the benchmark does what the trainer
does), so peak memory is the stored layer inputs plus one layer's working memory. Each case does a 512-token
warm-up step, then one timed step.

    .venv/bin/python benchmarks/model_step.py            # the table (takes a few minutes)
    .venv/bin/python benchmarks/model_step.py --case ours --tokens 4096   # one case, JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from genomelm.model import GlmForCausalLM, ModelConfig, RunOptions
from genomelm.train.memory import LayerRunner

PRESET = "small"
OUR_LENGTHS = (4096, 16384, 65536)
REFERENCE_LENGTH = 4096
WARMUP_TOKENS = 512


RUNNER = LayerRunner(recompute=True, offload=False, keep_selection=True)


def _batch(tokens: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(1, vocab, (1, tokens), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run_ours(tokens: int) -> dict:
    torch.manual_seed(0)
    config = ModelConfig.preset(PRESET)
    model = GlmForCausalLM.from_config(config, RunOptions())
    for length in (WARMUP_TOKENS, tokens):
        ids, labels = _batch(length, config.vocab_size)
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model.loss(ids, labels, layer_runner=RUNNER).backward()
        seconds = time.perf_counter() - start
    return {
        "case": "genomelm",
        "tokens": tokens,
        "seconds": seconds,
        "peak_rss_mb": _peak_rss_mb(),
        "route_table": model.route_table(),
    }


def run_reference(tokens: int) -> dict:
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel

    torch.manual_seed(0)
    config = ModelConfig.preset(PRESET)
    ours = GlmForCausalLM.from_config(config, RunOptions())
    fields = config.text_config_dict()
    fields.pop("model_type")
    ref_config = Glm5NextTextConfig(**fields)
    ref_config._attn_implementation = "eager"
    ref = Glm5NextTextModel(ref_config).float()
    state = ours.state_dict()
    head = state.pop("lm_head.weight").clone().requires_grad_(True)
    ref.load_state_dict(state, strict=True)
    del ours, state
    for length in (WARMUP_TOKENS, tokens):
        ids, labels = _batch(length, config.vocab_size)
        ref.zero_grad(set_to_none=True)
        start = time.perf_counter()
        hidden = ref(input_ids=ids, use_cache=False).last_hidden_state
        F.cross_entropy((hidden @ head.T).flatten(0, 1), labels.flatten(), ignore_index=-100).backward()
        seconds = time.perf_counter() - start
    return {"case": "transformers", "tokens": tokens, "seconds": seconds, "peak_rss_mb": _peak_rss_mb()}


# glibc malloc settings that keep freed memory in the process instead of returning it to the OS: at 64k tokens
# most temporaries are above glibc's mmap threshold, and fresh pages for each of them cost more than the math.
TUNED_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(16 * 2**30),
    "MALLOC_TRIM_THRESHOLD_": str(64 * 2**30),
    "MALLOC_TOP_PAD_": str(2**30),
}


def _spawn(case: str, tokens: int, env: dict[str, str] | None = None) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--case", case, "--tokens", str(tokens)]
    done = subprocess.run(
        command, capture_output=True, text=True, check=False, env={**os.environ, **(env or {})}
    )
    if done.returncode != 0:
        raise RuntimeError(f"case {case} at {tokens} tokens failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=["ours", "reference"], help="run one case here and print JSON")
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    if args.case:
        result = run_ours(args.tokens) if args.case == "ours" else run_reference(args.tokens)
        print(json.dumps(result))
        return

    print(
        f"preset {PRESET!r}, batch 1, forward + backward of the mean loss, {torch.get_num_threads()} "
        "threads; genomelm layers run through the trainer's LayerRunner (recompute on, selections kept); "
        "fresh process per case",
        flush=True,
    )
    reference = _spawn("reference", REFERENCE_LENGTH)
    ours = {n: _spawn("ours", n) for n in OUR_LENGTHS}
    tuned = {n: {**_spawn("ours", n, TUNED_MALLOC), "case": "genomelm*"} for n in (16384, 65536)}
    ref_speed = reference["tokens"] / reference["seconds"]
    rows = [reference, *ours.values(), *tuned.values()]
    print(
        f"{'case':<13} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'peak RSS MB':>12} {'speed vs ref':>13} "
        f"{'RSS vs 16k':>11}"
    )
    for row in rows:
        speed = row["tokens"] / row["seconds"]
        versus_ref = (
            f"{speed / ref_speed:.1f}x"
            if row["case"] == "genomelm" and row["tokens"] == REFERENCE_LENGTH
            else ""
        )
        base = {"genomelm": ours, "genomelm*": tuned}.get(row["case"])
        versus_16k = f"{row['peak_rss_mb'] / base[16384]['peak_rss_mb']:.2f}x" if base else ""
        print(
            f"{row['case']:<13} {row['tokens']:>7} {row['seconds']:>8.2f} {speed:>9.0f} "
            f"{row['peak_rss_mb']:>12.0f} {versus_ref:>13} {versus_16k:>11}"
        )
    print(
        "genomelm*: the same with glibc malloc tuned to keep freed memory ("
        + " ".join(f"{k}={v}" for k, v in TUNED_MALLOC.items())
        + ")"
    )
    print(f"\nroutes at {OUR_LENGTHS[-1]} tokens:\n{ours[OUR_LENGTHS[-1]]['route_table']}")


if __name__ == "__main__":
    main()

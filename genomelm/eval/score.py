"""Per-token held-out loss of a model, one window at a time.

A model is anything with ``.loss(input_ids[B, S], labels[B, S], reduction="none") -> [B, S]`` (nats, 0
where labels == -100) and parameters; a window is a `genomelm.data.windows.Window`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from genomelm.data.vocab import IGNORE_INDEX
from genomelm.data.windows import Window
from genomelm.train.precision import autocast_for
from genomelm.train.scoring import WindowShare


@dataclass
class Scores:
    """Per-token loss of W windows of S tokens; position t is the prediction of token t + 1.

    loss: float32 [W, S] nats (0 where not valid); valid: bool [W, S] (a real next base);
    softmask: bool [W, S] (the predicted base is soft-masked, i.e. a repeat);
    cut_loss: float32 [W, L] loss of the last bucket's L positions with only the preceding bucket as
    context, or None when not scored; cut_start: the last bucket's first position.
    """

    loss: np.ndarray
    valid: np.ndarray
    softmask: np.ndarray
    cut_loss: np.ndarray | None = None
    cut_start: int = 0


def last_bucket_start(seq: int, bucket: int) -> int:
    """First position of the last (possibly shorter) bucket of a window of `seq` positions."""
    return (seq - 1) // bucket * bucket


def _device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def token_losses(model: torch.nn.Module, window: Window, precision: str) -> np.ndarray:
    """float32 [L] loss of each position of `window` the model reads (0 where the label is ignored), under the
    run's `precision`."""
    device = _device(model)
    with autocast_for(precision, device):
        out = model.loss(window.input_ids[None].to(device), window.labels[None].to(device), reduction="none")
    return out[0].float().cpu().numpy()


def score_windows(
    model: torch.nn.Module,
    windows: Sequence[Window],
    bucket: int,
    context_cut: bool,
    progress: bool = False,
    precision: str = "auto",
    share: WindowShare | None = None,
) -> Scores:
    """Score every window of `windows` (all of one length S) with `model`, in `precision` ("auto": bf16 on
    CUDA as in training, fp32 on the CPU); with `share`, the dp replicas split the windows (each scored once,
    the scores gathered on every rank).

    With `context_cut`, the last bucket's positions [c, S) are scored again from input_ids[c - bucket:S]
    only (the preceding bucket as context), c = `last_bucket_start(S, bucket)`; needs at least 2 buckets.
    """
    if not len(windows):
        raise ValueError("no windows to score")
    share = share if share is not None else WindowShare()
    seq = len(windows[0].input_ids)
    cut_start = last_bucket_start(seq, bucket)
    if context_cut and cut_start < bucket:
        raise ValueError(
            f"the context cut needs at least 2 buckets per window; SEQ {seq} holds one of {bucket}"
        )
    valid = np.zeros((len(windows), seq), dtype=bool)
    softmask = np.zeros((len(windows), seq), dtype=bool)
    for i in range(len(windows)):
        labels = windows[i].labels
        if len(labels) != seq:
            raise ValueError(f"window {i} has {len(labels)} tokens, window 0 has {seq}")
        valid[i] = (labels != IGNORE_INDEX).numpy()
        softmask[i] = windows[i].predicted_softmask.numpy()

    def job(i: int) -> tuple[np.ndarray, np.ndarray | None]:
        window = windows[i]
        loss = np.where(valid[i], token_losses(model, window, precision), 0.0).astype(np.float32)
        if not context_cut:
            return loss, None
        part = token_losses(model, window.cropped(cut_start - bucket), precision)[bucket:]
        return loss, np.where(valid[i, cut_start:], part, 0.0).astype(np.float32)

    def report(done: int, total: int) -> None:
        print(f"  window {done}/{total}", flush=True)

    model.eval()
    with torch.no_grad():
        rows = share.run(
            [functools.partial(job, i) for i in range(len(windows))], report if progress else None
        )
    loss = np.stack([row[0] for row in rows])
    cut_loss = np.stack([row[1] for row in rows]) if context_cut else None
    return Scores(loss, valid, softmask, cut_loss, cut_start)

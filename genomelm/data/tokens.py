"""A window's tokens as the model reads them: next-base labels, the soft-mask of the base each position
predicts, the other strand (reverse complement), the length before padding. Pure functions;
:class:`genomelm.data.windows.Window` derives its labels and soft-mask from them and training's
reverse-complement augmentation reads the other strand with them."""

from __future__ import annotations

import functools

import torch

from genomelm.data.vocab import COMPLEMENT_CODE, IGNORE_INDEX, Vocabulary


def labels_for(input_ids: torch.Tensor, vocab: Vocabulary) -> torch.Tensor:
    """Next-base labels LongTensor[S] of ``input_ids`` LongTensor[S] (ids of ``vocab``).

    labels[t] = input_ids[t + 1], except IGNORE_INDEX (-100) where the next token is N or padding and at the
    last position. Every :class:`~genomelm.data.windows.Window`'s labels are these.
    """
    pad_id, n_id = vocab.ignored_ids
    following = input_ids[1:]
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:-1] = torch.where((following == pad_id) | (following == n_id), IGNORE_INDEX, following)
    return labels


def predicted_softmask(softmask: torch.Tensor) -> torch.Tensor:
    """BoolTensor[S]: at position t the soft-mask flag of the base it predicts, ``softmask[t + 1]``; False at
    the last position, which predicts nothing. The loss at t is that of base t + 1 (see
    :func:`labels_for`)."""
    predicted = torch.zeros_like(softmask)
    predicted[:-1] = softmask[1:]
    return predicted


@functools.lru_cache(maxsize=8)
def complement_table(vocab: Vocabulary) -> torch.Tensor:
    """LongTensor[max id + 1]: token id -> id of the complementary base; -1 for ids that are no base."""
    table = torch.full((max(vocab.code_to_id) + 1,), -1, dtype=torch.long)
    for code, token_id in enumerate(vocab.code_to_id):
        table[token_id] = vocab.code_to_id[COMPLEMENT_CODE[code]]
    return table


def unpadded_length(input_ids: torch.Tensor, vocab: Vocabulary) -> int:
    """Tokens before the trailing padding of a window (a record shorter than SEQ is right-padded)."""
    real = torch.nonzero(input_ids != vocab.pad_id)
    return int(real[-1]) + 1 if len(real) else 0


def reverse_complement(
    input_ids: torch.Tensor, softmask: torch.Tensor, vocab: Vocabulary
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window read from the other strand: (input_ids LongTensor[S], softmask BoolTensor[S]).

    Bases are complemented through ``vocab``'s ids (A<->T, C<->G, N stays N) and their order reversed, and
    the soft-mask is reversed with them. Trailing padding stays at the end, so a padded window stays a
    valid window; labels are rebuilt with :func:`labels_for`. Inputs are not modified.
    """
    if input_ids.dim() != 1 or input_ids.shape != softmask.shape:
        raise ValueError(
            f"input_ids and softmask must be [S] alike, got {tuple(input_ids.shape)} and "
            f"{tuple(softmask.shape)}"
        )
    table = complement_table(vocab)
    if len(input_ids) and (int(input_ids.min()) < 0 or int(input_ids.max()) >= len(table)):
        raise ValueError(
            f"token ids outside 0..{len(table) - 1}: not ids of this vocabulary {vocab.code_to_id}"
        )
    complement = table[input_ids]
    if bool((complement < 0).any()):
        stray = sorted(set(input_ids[complement < 0].tolist()))[:5]
        raise ValueError(f"token ids {stray} are not bases of this vocabulary {vocab.code_to_id}")
    length = unpadded_length(input_ids, vocab)
    ids, mask = input_ids.clone(), softmask.clone()
    ids[:length] = complement[:length].flip(0)
    mask[:length] = softmask[:length].flip(0)
    return ids, mask

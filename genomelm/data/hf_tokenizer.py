"""The project's vocabulary as a Hugging Face tokenizer: one token per base, for exported model folders.

Built with `tokenizers` (a WordLevel model over single characters) and saved by transformers'
`PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(folder)` loads it with no genomelm installed. It
reads text as the data stage does: lower case (soft-masked repeats) as upper case, IUPAC ambiguity codes as N,
whitespace dropped; any other character becomes N (the unknown token) where `genomelm data` refuses the file.
No BOS or EOS is added: a window's ids are its bases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from genomelm.data.vocab import CODE_NAMES, IUPAC_AMBIGUOUS, LETTERS, PAD, Vocabulary

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
UNK_TOKEN = "N"


def dna_tokenizer(vocab: Vocabulary, max_length: int) -> PreTrainedTokenizerFast:
    """A tokenizer mapping A, C, G, T, N (either case, IUPAC codes as N) to `vocab`'s ids and `<pad>` to its
    pad id; `max_length`: the window length the model was trained on (tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ids = {PAD_TOKEN: vocab.code_to_id[PAD]}
    ids |= {letter: vocab.code_to_id[CODE_NAMES.index(letter)] for letter in LETTERS}
    ambiguous = IUPAC_AMBIGUOUS + IUPAC_AMBIGUOUS.lower() + "n"
    tokenizer = Tokenizer(models.WordLevel(ids, unk_token=UNK_TOKEN))
    tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.Replace(Regex(r"\s+"), ""),
            normalizers.Replace(Regex(f"[{ambiguous}]"), "N"),
            *(normalizers.Replace(letter.lower(), letter) for letter in "ACGT"),
        ]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # ids back to one string, no spaces between bases
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=max_length,
        padding_side="right",
        model_input_names=["input_ids", "attention_mask"],
    )

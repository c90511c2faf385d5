"""Scoring the model before and after training, and what genomicists read from it: the loss per position
bucket (`evaluate`, `buckets`, `report`, `plot`), the copy probe (`probe`), per-base tracks (`tracks`),
variant effects (`variants`, with its VCF reading and writing in `vcf`) and embeddings (`embed`). Each runs on
the run's mesh through `genomelm.run.scoring`; the commands are in `genomelm.commands`.
"""

"""genomelm: long-context genome language modelling.

Packages, each importing only those listed before it (`tests/test_layering.py` checks it):
- `genomelm.data`: genomes -> prepared windows (FASTA / 2bit reading, regions, the vocabulary);
- `genomelm.model`: GLM-5.3-Flash in plain PyTorch, checkpoints in Hugging Face layout; of `data`, only
  `genomelm.data.vocab`;
- `genomelm.parallel`: the model over many processes (context, expert and data parallelism, FSDP2, sharded
  checkpoints, the local launcher);
- `genomelm.train`: the training run (config, loop, memory plan, launchers);
- `genomelm.eval`: scoring the model before and after training;
- `genomelm.cli`: the `genomelm` command.
"""

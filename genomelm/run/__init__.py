"""The run core: what every command's run shares, training or not.

- `config`: the run settings (`TrainConfig`, one dataclass per owner; `readout_config`: the evaluation's
  and the read-outs' groups; `setting_checks`: the checks they share);
- `models`: the device, the model config and the before/after models a command reads;
- `precision`: bf16 or fp32, and what autocast and FSDP2 take from it;
- `launchers`: where a run's ranks run (one process, local ranks, Ray Train workers) and the layout checks
  before any of them starts; `ray_launch`: the Ray side of it (`ray_logging`: what each Ray process runs
  first);
- `lock` and `stop`: one owner per run folder, and signals turned into the run's stop request;
- `scoring`: the forward pass that scores windows on the run's mesh (eval, the read-outs, held-out eval in
  training, and what `genomelm plan stage=eval` traces);
- `metrics`: the run's `metrics.jsonl`, W&B and memory readings;
- `failures`: how a command ends: one line and an exit status.

Imports `genomelm.parallel`, `genomelm.model` and `genomelm.data`; never `train`, `eval`, `plan` or the
commands (`tests/test_layering.py`).
"""

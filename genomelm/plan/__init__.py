"""`genomelm plan`: will a run fit the GPUs, and how fast, traced from the real code on fake tensors.

- `check`: `check_fits` (what every command meant for GPUs calls first) and `describe_run` (`dry_run=true`);
- `trace`: the training step and the scoring step traced on fake tensors (`torch.distributed._tools`'
  MemTracker and a FLOP/byte counter), at sizes extrapolated to the full window;
- `memory`, `timing`, `comm`, `roofline`: memory per rank, step time op by op against the GPU's peaks, what
  each rank moves over its links;
- `search`: every layout of the GPUs ranked by projected tokens/s; `report`: what the command prints;
- `layouts`: the GPUs it knows, what the projection assumes, a layout and its verdict;
- `simulate`: the run's own multi-GPU step on fake CUDA tensors (NCCL's rules, host syncs);
- `fla_stand_in`: fla's kernels as custom ops the traces can see.

Imports the run core and, of training, only the step and its memory stack it traces
(`genomelm.train.step`, `genomelm.train.memory`); only the commands import it.
"""

"""The command line's stages, one module each (`genomelm <stage>`, dispatched by `genomelm.cli`): each parses
its arguments, checks what it can before anything starts (a run meant for GPUs is planned first), runs its
stage through the run core, and ends with one line and an exit status on failure (`genomelm.run.failures`).
"""

"""Imported first by the local launcher's forkserver (`multiprocessing.set_forkserver_preload`), and nowhere
else: the server, and every rank it forks, ignore SIGINT and SIGTERM.

A signal to the whole process group (Ctrl-C in a terminal, `kill -TERM -<pgid>`, Slurm or a container runtime
stopping a job) then reaches the run through its launcher alone, which turns it into a request its ranks act
on (`genomelm.parallel.launch`); a rank or the server dying of it first would look like a crash. The launcher
starts the server with both signals blocked, so none can arrive before this module has run: one that came
meanwhile is pending, and setting it to SIG_IGN discards it.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

for _signal in STOP_SIGNALS:
    signal.signal(_signal, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

"""Imported first by the local launcher's forkserver (`multiprocessing.set_forkserver_preload`), and nowhere
else: the server, and every rank it forks, ignore SIGINT and SIGTERM.

A signal to the whole process group (Ctrl-C in a terminal, `kill -TERM -<pgid>`, Slurm or a container runtime
stopping a job) then reaches the run through its launcher alone, which turns it into a request its ranks act
on (`genomelm.parallel.launch`); a rank or the server dying of it first would look like a crash. The launcher
starts the server with both signals blocked, so none can arrive before this module has run: one that came
meanwhile is pending, and setting it to SIG_IGN discards it.

On Linux the server also dies with the launcher that started it (PR_SET_PDEATHSIG, SIGKILL): it holds no
state of a run, and a launcher killed outright would otherwise leave it to tear down its preloaded modules
for seconds after its ranks (`genomelm.parallel.launcher_watch`) have gone. The ranks it forks do not inherit
the setting.
"""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

for _signal in STOP_SIGNALS:
    signal.signal(_signal, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

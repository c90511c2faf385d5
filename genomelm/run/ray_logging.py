"""What every Ray worker process runs first (Ray's `worker_process_setup_hook`, set by
`genomelm.run.ray_launch.start_ray`): Ray Train's chatter kept out of the run's output. A module of its own,
importing neither torch nor the rest of genomelm, since Ray imports it in each of its processes, most of
which never run torch (the Train controller and its helper actors: about 1 s of CPU less for each)."""

from __future__ import annotations

import importlib
import logging

QUIET_LOGGERS = {  # Ray modules whose `logger` says what the run does not need to read, and the level kept
    "ray.train.v2._internal.execution.context": logging.WARNING,
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": logging.ERROR,
    # On a busy machine the first resource request can outwait its 5 s; Ray logs that as a warning with a
    # traceback ("safe to ignore", it says) and asks again.
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client": logging.ERROR,
}


class _AtLeast(logging.Filter):
    """Keeps a logger's records at `level` and above. A filter, not the logger's level: Ray Train's controller
    and workers `dictConfig` the "ray.train" logger, which resets the levels of the loggers below it."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def quiet_ray_loggers() -> None:
    """In each Ray worker process: drop Ray Train's per-report lines, the placement-group cleaner's warning
    that the state API (served by the dashboard, which a local run does not start) is unavailable, and the
    resource request's transient time-out."""
    for module, level in QUIET_LOGGERS.items():
        logger = importlib.import_module(module).logger  # some are named by file, not module
        if not any(isinstance(f, _AtLeast) for f in logger.filters):
            logger.addFilter(_AtLeast(level))


WORKER_SETUP_HOOK = f"{__name__}.{quiet_ray_loggers.__name__}"

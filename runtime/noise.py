"""Library noise goes to the run's log file, not the console.

Deprecations and "optional package not installed" notices (megatron-core warns on import
that apex and transformer-engine are missing) are addressed to a library's developers; a
user of a run can do nothing about them, and a console full of them hides the warnings that
matter. `route_library_noise` sends them to RUN_DIR/logs/warnings.log, one entry each, with
the process they came from; every other warning still reaches the console as before.

Noise is:
- a warning of one of CATEGORIES, from anywhere;
- any warning that code of one of LIBRARIES emits (the module that called `warnings.warn`,
  whatever `stacklevel` blames), and any record of those libraries' loggers.

The supervisor routes its own process for as long as it runs, and every role process from
its start, before the role's class is imported. A library that attaches its own console
handler to its logger after that (transformers does, when first imported) keeps it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import warnings
from pathlib import Path

CATEGORIES: tuple[type[Warning], ...] = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
LIBRARIES: tuple[str, ...] = ("megatron", "transformer_engine", "apex", "transformers")
LOG_NAME = "logs/warnings.log"  # under the run directory


class NoiseRoute:
    """Installed by `route_library_noise`; `close()` puts the previous hooks back."""

    def __init__(self, path: str | os.PathLike, *, source: str,
                 categories: tuple[type[Warning], ...] = CATEGORIES, libraries: tuple[str, ...] = LIBRARIES):
        self.path = Path(path)
        self.source = source
        self.categories, self.libraries = categories, libraries
        self._lock = threading.Lock()
        self._saved = warnings.catch_warnings()  # the filters and hook that close() puts back
        self._saved.__enter__()
        # the categories Python ignores by default (deprecations) must reach the hook to be logged
        for category in categories:
            warnings.filterwarnings("default", category=category)
        self._previous = warnings.showwarning
        warnings.showwarning = self._show
        self._handler = _FileHandler(self)
        self._loggers = {}
        for name in libraries:
            logger = logging.getLogger(name)
            self._loggers[name] = (logger.propagate, list(logger.handlers))
            for h in logger.handlers:
                if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.stdout):
                    logger.removeHandler(h)
            logger.addHandler(self._handler)
            logger.propagate = False

    def is_noise(self, category: type[Warning], emitter: str) -> bool:
        """Whether a warning of `category` that module `emitter` emitted goes to the file."""
        return issubclass(category, self.categories) or emitter.split(".")[0] in self.libraries

    def write(self, text: str) -> None:
        """Append one entry; each is a single write, so processes sharing the file do not interleave."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        data = f"{stamp} {self.source} (pid {os.getpid()}): {text.rstrip()}\n".encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)

    def close(self) -> None:
        self._saved.__exit__(None, None, None)
        for name, (propagate, handlers) in self._loggers.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self._handler)
            for h in handlers:
                if h not in logger.handlers:
                    logger.addHandler(h)
            logger.propagate = propagate

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if file is None and self.is_noise(category, _emitter()):  # an explicit file: the caller chose
            self.write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            self._previous(message, category, filename, lineno, file, line)


class _FileHandler(logging.Handler):
    def __init__(self, route: NoiseRoute):
        super().__init__()
        self.route = route
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.route.write(self.format(record))
        except Exception:
            self.handleError(record)


def route_library_noise(run_dir: str | os.PathLike, *, source: str) -> NoiseRoute:
    """Send this process's library noise to RUN_DIR/logs/warnings.log, its entries marked
    with `source` (the role's name, or "supervisor"); the file is made at the first entry."""
    return NoiseRoute(Path(run_dir) / LOG_NAME, source=source)


def _emitter() -> str:
    """The module of the code that emitted the warning being shown: the first frame outside
    the warnings machinery and this module."""
    frame = sys._getframe(2)  # _emitter <- NoiseRoute._show <- its caller
    while frame is not None and frame.f_globals.get("__name__") in ("warnings", __name__):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""

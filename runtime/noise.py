"""Library noise goes to the run's log file, not the console.

Deprecations and "optional package not installed" notices (megatron-core warns on import
that apex and transformer-engine are missing) are addressed to a library's developers; a
user of a run can do nothing about them, and a console full of them hides the warnings that
matter. `route_library_noise` sends them to RUN_DIR/logs/warnings.log, one entry each, with
the process they came from; every other warning still reaches the console as before.

Noise is:
- a warning of one of CATEGORIES, from anywhere;
- any warning that code of one of LIBRARIES emits (the module that called `warnings.warn`,
  whatever `stacklevel` blames), and any record of those libraries' loggers;
- any warning about a file inside one of LIBRARIES: the compiler's SyntaxWarnings, raised
  while a library module is imported (megatron-core 0.19's "invalid escape sequence"), name
  that file and come from the importer's frame.

The supervisor routes its own process for as long as it runs, and every role process from
its start, before the role's class is imported. A console handler that a library attaches
to its logger (transformers does, when first imported) is left off while a route is open.
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


_lock = threading.RLock()
_routes: list[NoiseRoute] = []  # open routes, newest last: noise goes to the newest
_before: dict = {}  # what the first open route replaced, put back when the last one closes


class NoiseRoute:
    """An open route of this process's library noise into `path`; `close()` ends it.

    Routes nest (a test may run two supervisors): the newest open one gets the noise, and the
    hooks are installed by the first and removed when the last one closes, in any order.
    """

    def __init__(self, path: str | os.PathLike, *, source: str):
        self.path = Path(path)
        self.source = source
        with _lock:
            if not _routes:
                _install()
            _routes.append(self)

    def write(self, text: str) -> None:
        """Append one entry; each is a single write, so processes sharing the file do not interleave."""
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        data = f"{stamp} {self.source} (pid {os.getpid()}): {text.rstrip()}\n".encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def close(self) -> None:
        with _lock:
            if self in _routes:
                _routes.remove(self)
                if not _routes:
                    _uninstall()


def is_noise(category: type[Warning], emitter: str, filename: str = "") -> bool:
    """Whether a warning of `category` that module `emitter` emitted, about `filename`, goes
    to the log file."""
    return (issubclass(category, CATEGORIES) or emitter.split(".")[0] in LIBRARIES
            or any(part in LIBRARIES for part in Path(filename).parts[:-1]))


def route_library_noise(run_dir: str | os.PathLike, *, source: str) -> NoiseRoute:
    """Send this process's library noise to RUN_DIR/logs/warnings.log, its entries marked
    with `source` (the role's name, or "supervisor"); the file is made at the first entry."""
    return NoiseRoute(Path(run_dir) / LOG_NAME, source=source)


def _write(text: str) -> None:
    with _lock:
        route = _routes[-1] if _routes else None
        if route is not None:
            route.write(text)


def _show(message, category, filename, lineno, file=None, line=None) -> None:
    # an explicit file is a caller's choice of where; with no route open (ours was wrapped by a
    # later hook that outlived us) everything passes through
    if file is None and _routes and is_noise(category, _emitter(), str(filename)):
        _write(warnings.formatwarning(message, category, filename, lineno, line))
    else:
        _before["showwarning"](message, category, filename, lineno, file, line)


class _FileHandler(logging.Handler):
    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            _write(self.format(record))
        except Exception:
            self.handleError(record)


def _install() -> None:
    _before["showwarning"] = warnings.showwarning
    warnings.showwarning = _show
    # the categories Python ignores by default (deprecations) must reach the hook to be logged
    _before["filters"] = [("default", None, c, None, 0) for c in CATEGORIES]
    for category in CATEGORIES:
        warnings.filterwarnings("default", category=category)
    handler = _before["handler"] = _FileHandler()
    _before["loggers"] = {}
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        _before["loggers"][name] = (logger.propagate, logger.handlers)
        # a list that refuses console handlers, also those a library adds when it is first
        # imported, after this (transformers' own stderr handler)
        logger.handlers = _NoConsole(h for h in logger.handlers if not _is_console(h))
        logger.addHandler(handler)
        logger.propagate = False


def _uninstall() -> None:
    if warnings.showwarning is _show:  # else a later hook wraps ours, which now passes all through
        warnings.showwarning = _before["showwarning"]
    for entry in _before["filters"]:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
    mutated = getattr(warnings, "_filters_mutated", None)  # what filterwarnings calls (3.10-3.13)
    if mutated is not None:
        mutated()  # so the module's caches of past decisions see the change
    for name, (propagate, handlers) in _before["loggers"].items():
        logger = logging.getLogger(name)
        logger.handlers = [h for h in handlers if h is not _before["handler"]]
        logger.propagate = propagate


def _is_console(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stderr, sys.stdout)


class _NoConsole(list):
    """A logger's handler list while routed: `Logger.addHandler` appends, and a console handler
    is dropped instead."""

    def append(self, handler: logging.Handler) -> None:
        if not _is_console(handler):
            super().append(handler)


def _emitter() -> str:
    """The module of the code that emitted the warning being shown: the first frame outside
    the warnings machinery and this module."""
    frame = sys._getframe(2)  # _emitter <- _show <- its caller
    while frame is not None and frame.f_globals.get("__name__") in ("warnings", __name__):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""

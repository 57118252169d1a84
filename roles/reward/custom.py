"""Load a user's reward function named by ``custom_rm_path`` (and any other function a flag
names the same way: ``load_function``, e.g. for --dynamic-sampling-filter-path).

Accepted forms:

- ``package.module:function`` — imported like any module (it must be on ``sys.path``);
- ``path/to/file.py:function`` — loaded from that file;
- ``package.module.function`` — the miles/slime ``--custom-rm-path`` spelling.

The function takes one sample dict, or with ``group_rm`` the list of a group's sample
dicts, and returns a float (or a list of floats); it may be ``async def``. A sample dict
is ``{"index", "group_index", "prompt", "response", "label", "metadata"}``. Unlike
miles, there is no ``args`` parameter: the function gets only the data.
"""

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

_FORMS = "'package.module:function', 'path/to/file.py:function' or 'package.module.function'"


def load_reward_function(custom_rm_path: str) -> Callable:
    """Import and return the function that ``custom_rm_path`` names; ValueError if it cannot."""
    return load_function(custom_rm_path, "custom_rm_path")


def load_function(spec: str, setting: str) -> Callable:
    """Import and return the function that ``spec`` names; ValueError naming ``setting`` (the
    config field that holds ``spec``) if it cannot."""
    function = load_object(spec, setting)
    if not callable(function):
        name = spec.rpartition(":" if ":" in spec else ".")[2]
        raise ValueError(f"{setting}={spec!r}: {name!r} is a {type(function).__name__}, not a function")
    return function


def load_object(spec: str, setting: str):
    """Import and return whatever ``spec`` names (a function, or data such as a list of tool
    specs); ValueError naming ``setting`` if it cannot."""
    if ":" in spec:
        location, _, name = spec.rpartition(":")
    else:
        location, _, name = spec.rpartition(".")
    if not location or not name:
        raise ValueError(f"{setting}={spec!r} names no function; use {_FORMS}")
    if location.endswith(".py") or "/" in location:
        module = _load_file(spec, Path(location), setting)
    else:
        try:
            module = importlib.import_module(location)
        except ModuleNotFoundError as e:
            raise ValueError(f"{setting}={spec!r}: cannot import {location!r} ({e})") from e
    if not hasattr(module, name):
        raise ValueError(f"{setting}={spec!r}: {location!r} has no attribute {name!r}")
    return getattr(module, name)


def _load_file(spec: str, path: Path, setting: str):
    path = path.expanduser().resolve()
    if not path.is_file():
        raise ValueError(f"{setting}={spec!r}: no such file {str(path)!r}")
    # A name unique per file, registered in sys.modules so that pickling and dataclasses
    # defined in the user's file work as they would in an imported module.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"tandem_custom_rm_{path.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module

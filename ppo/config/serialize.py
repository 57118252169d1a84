"""Config <-> plain dicts (run_dir/config.json, checkpoints) and flat-name overrides."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ppo.config.schema import FIELDS, RM_TYPES, ConfigError, PPOConfig
from ppo.config.validate import ensure_valid


def to_dict(cfg: PPOConfig) -> dict[str, dict[str, Any]]:
    """`{group: {field: value}}` of JSON types (tuples become lists)."""
    return {
        group: {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        for group, values in dataclasses.asdict(cfg).items()
    }


def from_dict(data: Mapping[str, Any], *, rm_types: Sequence[str] = RM_TYPES) -> PPOConfig:
    """The validated config that `to_dict` produced. Unknown groups or keys are errors; a
    missing key takes its default. Raises ConfigError listing every problem."""
    problems: list[str] = []
    flat: dict[str, Any] = {}
    for group, values in data.items():
        if group not in _GROUPS:
            problems.append(f"{group!r}: unknown config group; allowed: {', '.join(_GROUPS)}")
        elif not isinstance(values, Mapping):
            problems.append(f"{group!r}: expected a mapping of fields, got {type(values).__name__}")
        else:
            for key, value in values.items():
                spec = FIELDS.get(key)
                if spec is None or spec.group != group:
                    home = f" (it belongs to {spec.path})" if spec else ""
                    problems.append(f"{group}.{key}: unknown config key{home}")
                else:
                    flat[key] = _from_json(spec.kind, value)
    if problems:
        raise ConfigError(problems)
    return ensure_valid(override(PPOConfig(), **flat), rm_types=rm_types)


def override(cfg: PPOConfig, **values: Any) -> PPOConfig:
    """A copy of `cfg` with fields replaced by flat name (`lr=1e-5` sets optimizer.lr).
    Not validated: call `validate` on the result. Unknown names raise ConfigError."""
    unknown = [f"{name}: unknown config field" for name in values if name not in FIELDS]
    if unknown:
        raise ConfigError(unknown)
    by_group: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        by_group.setdefault(FIELDS[name].group, {})[name] = value
    return dataclasses.replace(
        cfg, **{g: dataclasses.replace(getattr(cfg, g), **kv) for g, kv in by_group.items()})


def _from_json(kind: type, value: Any) -> Any:
    # JSON has no tuples, and a hand-written file may spell the float 1.0 as 1; anything else
    # is left as it is for validate() to judge.
    if kind is tuple and isinstance(value, list):
        return tuple(value)
    if kind is float and type(value) is int:
        return float(value)
    return value


_GROUPS = tuple(f.name for f in dataclasses.fields(PPOConfig))

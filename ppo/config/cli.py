"""The command line: `--recipe NAME` picks a base config, then one flag per config field
(miles' names) overrides it. Every problem — unknown flags, unparsable values, invalid
settings — comes back in one ConfigError.

Flags are derived from the dataclass fields: bools take `--x` / `--no-x`; optional fields
take `none` to unset; tuples of ints take one or more values. The help text never repeats
defaults: they live in the dataclasses and the recipes.

    from ppo.config.cli import parse_args
    cfg = parse_args(["--recipe", "qwen3_4b_ppo", "--hf-checkpoint", "/models/Qwen3-4B"])
"""

from __future__ import annotations

import argparse
import difflib
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ppo.config.schema import FIELDS, RM_TYPES, ConfigError, FieldSpec, PPOConfig
from ppo.config.serialize import override
from ppo.config.validate import allowed, validate
from ppo.config.recipes import DEFAULT_RECIPE, RECIPES, describe_recipes


class _ListRecipes(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, default: Any = argparse.SUPPRESS,
                 help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe_recipes())
        parser.exit(0)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """All config flags plus --recipe and --list-recipes; callers may add their own flags."""
    parser = argparse.ArgumentParser(
        prog=prog, description="Tandem PPO post-training.", allow_abbrev=False,
        exit_on_error=False, argument_default=argparse.SUPPRESS)
    parser.add_argument("--recipe", metavar="NAME",
                        help="base configuration the other flags override "
                        f"(default: {DEFAULT_RECIPE})")
    parser.add_argument("--list-recipes", action=_ListRecipes,
                        help="print the recipes with their one-line summaries and exit")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for spec in FIELDS.values():
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        _add_flag(groups[spec.group], spec)
    return parser


def parse_cli(parser: argparse.ArgumentParser,
              argv: Sequence[str] | None = None, *,
              rm_types: Sequence[str] = RM_TYPES,
              scheduler: Mapping[str, Any] | None = None) -> tuple[PPOConfig, argparse.Namespace]:
    """The validated config and the namespace (for flags the caller added to `parser`).
    `scheduler` holds the values Slurm's or torchrun's environment gives
    (ppo.config.cluster.from_environment); flags win over them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns, extras = parser.parse_known_args(argv)
    except argparse.ArgumentError as err:  # a flag without its value, or `--x=1` for a bool
        raise ConfigError([str(err)]) from None
    problems = _unknown(extras)
    values: dict[str, Any] = {}
    for name, raw in vars(ns).items():
        if name in FIELDS:
            try:
                values[name] = _parse_value(FIELDS[name], raw)
            except ValueError as err:
                problems.append(f"{FIELDS[name].flag} {raw!r} ({FIELDS[name].path}): {err}")
    recipe = getattr(ns, "recipe", DEFAULT_RECIPE)
    if recipe not in RECIPES:
        raise ConfigError(problems + [f"--recipe {recipe!r}: must be one of: {', '.join(RECIPES)}"])
    values = {**(scheduler or {}), **values}
    values.setdefault("run_dir", f"runs/{recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = override(RECIPES[recipe](), **values)
    problems += validate(cfg, rm_types=rm_types)
    if problems:
        raise ConfigError(problems)
    return cfg, ns


def parse_args(argv: Sequence[str] | None = None, *,
               rm_types: Sequence[str] = RM_TYPES) -> PPOConfig:
    """The validated config for `argv` (sys.argv[1:] when None); raises ConfigError."""
    return parse_cli(build_parser(), argv, rm_types=rm_types)[0]


def _add_flag(group: argparse._ArgumentGroup, spec: FieldSpec) -> None:
    words = [spec.meta.get("help", "")]
    if spec.kind is not bool:
        words.append(f"[{spec.kind.__name__ if spec.kind is not tuple else spec.item.__name__ + ' ...'}"
                     f"{' ' + allowed(spec) if allowed(spec) else ''}"
                     f"{'; none unsets' if spec.optional else ''}]")
    help_text = " ".join(w for w in words if w).replace("%", "%%")
    if spec.kind is bool:
        group.add_argument(spec.flag, dest=spec.name, action=argparse.BooleanOptionalAction,
                           help=help_text)
    else:
        # Values stay strings here and are converted by _parse_value, so that every bad
        # value is reported together instead of argparse stopping at the first one.
        metavar = _METAVARS[spec.item if spec.kind is tuple else spec.kind]
        group.add_argument(spec.flag, dest=spec.name, metavar=metavar,
                           nargs="+" if spec.kind is tuple else None, help=help_text)


_METAVARS = {int: "N", float: "X", str: "STR", tuple: "N"}


def _parse_value(spec: FieldSpec, raw: Any) -> Any:
    if spec.kind is bool:
        return raw  # argparse already produced True/False
    words = raw if isinstance(raw, list) else [raw]
    if spec.optional and len(words) == 1 and words[0].lower() == "none":
        return None
    if spec.kind is tuple:
        return tuple(_convert(spec.item, w) for w in words)
    return _convert(spec.kind, words[0])


def _convert(kind: type, word: str) -> Any:
    try:
        return kind(word)
    except ValueError:
        raise ValueError(f"expected {'an int' if kind is int else 'a ' + kind.__name__}") from None


def _unknown(extras: list[str]) -> list[str]:
    problems, after_flag = [], False
    for token in extras:
        if token.startswith("-"):
            flag = token.split("=", 1)[0]
            close = difflib.get_close_matches(flag, [s.flag for s in FIELDS.values()], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            problems.append(f"{flag}: unknown flag{hint}")
            after_flag = "=" not in token
        elif after_flag:  # the value of the unknown flag before it
            after_flag = False
        else:
            problems.append(f"{token!r}: unexpected argument")
    return problems

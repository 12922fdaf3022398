"""Build a Config from `--config FILE.yaml` plus `--section.field=value` overrides.

Values are parsed against the dataclass annotations, so a typo in a name or a value of
the wrong type fails before any process group is created, naming the file or flag.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from megalite.config import SECTIONS, Config, ConfigError
from megalite.parallel.pipeline.registry import SCHEDULES, training_schedules

_NONE = {"none", "null", "~"}
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


def _suggest(name: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(options)})"


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Turn a YAML or command-line value into the annotated type, or explain why not."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in _NONE):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), where)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, args))}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in _TRUE | _FALSE:
            return str(value).lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp in (int, float):
        try:
            number = float(value) if isinstance(value, str) else value
            if tp is int and (isinstance(number, bool) or float(number) != int(number)):
                raise ValueError
            return tp(number)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}") from None
    if tp is str:
        return str(value)
    if typing.get_origin(tp) is list:
        return _coerce_list(value, typing.get_args(tp)[0], where)
    raise ConfigError(f"{where}: unsupported field type {tp}")


def _coerce_list(value: Any, item_type: Any, where: str) -> list:
    """A YAML list, or on the command line `[a, b]` or whitespace/comma separated items."""
    if isinstance(value, str):
        value = yaml.safe_load(value) if value.strip().startswith("[") else value.replace(",", " ").split()
    if not isinstance(value, list):
        value = [value]
    return [_coerce(item, item_type, where) for item in value]


def set_field(cfg: Config, dotted: str, value: Any, where: str) -> None:
    section, _, name = dotted.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"{where}: unknown section {section!r}{_suggest(section, list(SECTIONS))}")
    types = _field_types(section)
    if name not in types:
        raise ConfigError(f"{where}: unknown field {dotted!r}{_suggest(name, list(types))}")
    setattr(getattr(cfg, section), name, _coerce(value, types[name], f"{where}: {dotted}"))


def load_yaml(cfg: Config, path: str) -> None:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    apply_mapping(cfg, data, path)


def apply_mapping(cfg: Config, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of sections (model:, train:, ...)")
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: section {section!r} must be a mapping of field: value")
        for name, value in values.items():
            set_field(cfg, f"{section}.{name}", value, where)


def _split_overrides(argv: Sequence[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """Accept `--config F`, `--config=F`, `--a.b=v` and `--a.b v`."""
    config_file, pairs, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --section.field=value")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            value, i = argv[i + 1], i + 1
        if key == "config":
            config_file = value
        else:
            pairs.append((key, value))
        i += 1
    return config_file, pairs


def parse_config(argv: Sequence[str]) -> Config:
    """Defaults, then the YAML file, then command-line overrides (last one wins)."""
    config_file, pairs = _split_overrides(argv)
    cfg = Config()
    if config_file:
        load_yaml(cfg, config_file)
    for key, value in pairs:
        set_field(cfg, key, value, "command line")
    if config_file:
        _command_line_picks_data_source(cfg, {key for key, _ in pairs}, config_file)
    return cfg


_CORPUS = ("paths", "train_paths", "valid_paths")


def _command_line_picks_data_source(cfg: Config, given: set[str], config_file: str) -> None:
    """The data source is two groups of fields (data.mock, the corpus fields), so "the command line wins" needs
    a rule: a source named on the command line drops the other source taken from the YAML, and one line says so.
    Both sources named on the same level are left for validate() to refuse."""
    d = cfg.data
    named = [name for name in _CORPUS if f"data.{name}" in given and getattr(d, name) is not None]
    if d.mock and "data.mock" in given and not named:
        dropped = [name for name in _CORPUS if getattr(d, name) is not None]
        for name in dropped:
            setattr(d, name, None)
        if dropped:
            _say(f"--data.mock=true: ignoring data.{', data.'.join(dropped)} from {config_file}")
    elif d.mock and named and "data.mock" not in given:
        d.mock = False
        _say(f"--data.{named[0]} given: ignoring data.mock=true from {config_file}")


def _say(line: str) -> None:
    """Print once per job, not once per rank (torchrun sets RANK; a plain run has none)."""
    if os.environ.get("RANK", "0") == "0":
        print(line, flush=True)


def _choices(tp: Any) -> tuple[str, ...]:
    """The values a Literal field accepts, also an optional one (e.g. model.norm), for --help; () for other types."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


def _registered() -> dict[str, dict[str, str]]:
    """Fields whose values name a registered thing (validation checks them): {field: {name: what it is}}."""
    return {"parallel.pipeline_schedule": {name: SCHEDULES[name].doc for name in training_schedules()}}


def help_text(prog: str = "pretrain_gpt.py") -> str:
    lines = [f"usage: {prog} [--config FILE.yaml] [--section.field=value ...]", ""]
    registered = _registered()
    for section, cls in SECTIONS.items():
        lines.append(f"{section}:")
        types = _field_types(section)
        for f in dataclasses.fields(cls):
            names = registered.get(f"{section}.{f.name}", {})
            kind = tuple(names) or _choices(types[f.name])
            choices = f" {{{'|'.join(kind)}}}" if kind else ""
            lines.append(f"  --{section}.{f.name}{choices} (default: {f.default})  {f.metadata['doc']}")
            lines += [f"      {name}: {doc}" for name, doc in names.items()]
        lines.append("")
    return "\n".join(lines)


def config_from_argv(argv: Sequence[str] | None = None) -> Config:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)
    return parse_config(argv)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def config_from_yaml_text(text: str, where: str) -> Config:
    """Rebuild a Config saved by dump_yaml (e.g. from a checkpoint)."""
    cfg = Config()
    apply_mapping(cfg, yaml.safe_load(text) or {}, where)
    return cfg

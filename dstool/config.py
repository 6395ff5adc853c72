"""One config style for every command: a pydantic model whose fields are the YAML keys (`--config FILE`)
and, with dashes, the CLI flags (generated from the model: defaults and help live only on the fields)."""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dstool.errors import UsageError


class CommandConfig(BaseModel):
    """Base of every command's options."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def positional(description: str, default: Any = ..., metavar: str | None = None) -> Any:
    """A field given on the command line without a flag (it may come from --config instead)."""
    return Field(default, description=description, json_schema_extra={"cli": {"positional": True, "metavar": metavar}})


def cli_extra(field) -> dict:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return extra.get("cli", {}) if isinstance(extra.get("cli", {}), dict) else {"hidden": True}


def _base_type(annotation):
    """`int | None` -> int; other annotations unchanged."""
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def _default(field) -> Any:
    return field.default_factory() if field.default_factory is not None else field.default


def add_options(parser: argparse.ArgumentParser, model: type[BaseModel]) -> None:
    """--config, then one flag per field (dashes for underscores); validation stays in the model."""
    parser.add_argument("--config", metavar="FILE.yaml", help="YAML file of options (keys as the flags, with "
                        "underscores); flags given here override it")
    for name, field in model.model_fields.items():
        extra = cli_extra(field)
        if extra.get("hidden"):
            continue
        base = _base_type(field.annotation)
        # a parsed type (or a field of several types) takes its text, the model parses it
        argtype = str if extra.get("text") else getattr(base, "cli_type", base)
        required = field.is_required()
        default = None if required else _default(field)
        help_ = (field.description or "").replace("%", "%%")
        help_ += " (required)" if required else "" if default in (None, [], {}) else f" [default: {default}]"
        if extra.get("positional"):
            parser.add_argument(name, nargs="?", default=None, metavar=extra.get("metavar") or name.upper(), help=help_)
            continue
        flag = extra.get("flag") or "--" + name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": name, "default": None, "help": help_}
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, **kwargs)
        elif typing.get_origin(base) is Literal:
            choices = typing.get_args(base)
            parser.add_argument(flag, type=type(choices[0]), choices=choices,
                                metavar="{" + ",".join(map(str, choices)) + "}", **kwargs)
        elif typing.get_origin(base) is dict:
            parser.add_argument(flag, action="append", metavar="KEY=VALUE", **kwargs)
        elif typing.get_origin(base) is list:
            item = typing.get_args(base)[0] if typing.get_args(base) else str
            parser.add_argument(flag, action="append", type=item, metavar=extra.get("metavar") or name.upper(),
                                **kwargs)
        elif "const" in extra:
            parser.add_argument(flag, nargs="?", const=extra["const"], type=argtype,
                                metavar=extra.get("metavar") or name.upper(), **kwargs)
        else:
            parser.add_argument(flag, type=argtype, metavar=extra.get("metavar") or name.upper(), **kwargs)


def overrides(ns: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The flags given on the command line, as field values (KEY=VALUE pairs made a mapping)."""
    values = {k: v for k, v in vars(ns).items() if k in model.model_fields and v is not None}
    for name, field in model.model_fields.items():
        if name in values and typing.get_origin(_base_type(field.annotation)) is dict:
            pairs = {}
            for item in values[name]:
                if "=" not in item:
                    flag = cli_extra(field).get("flag") or "--" + name.replace("_", "-")
                    raise UsageError(f"{flag} takes KEY=VALUE, got '{item}'")
                k, v = item.split("=", 1)
                pairs[k] = v
            values[name] = pairs
    return values


def _first_error(err: ValidationError, model: type[BaseModel]) -> str:
    e = err.errors()[0]
    where = ".".join(str(p) for p in e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        return f"unknown option '{where}'"
    if e["type"] == "missing":
        field = model.model_fields.get(str(e["loc"][0]))
        extra = cli_extra(field) if field else {}
        shown = extra.get("metavar") or where.upper() if extra.get("positional") else "--" + where.replace("_", "-")
        return f"missing {shown}: give it on the command line or as '{where}:' in --config"
    if not where:  # a check across options: its message names them
        return msg
    got = e.get("input")
    shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
    return f"{where}: {msg}{shown}"


def load_config(cls: type[BaseModel], path: str | None, flags: dict[str, Any]):
    """Build `cls` from an optional YAML file with `flags` (already-parsed CLI flags) on top."""
    values: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"config file {path} does not exist: pass a YAML file to --config")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise UsageError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"config file {path} must hold a mapping of option: value")
        values.update({str(k).replace("-", "_"): v for k, v in loaded.items()})
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        return cls(**values)
    except ValidationError as e:
        raise UsageError(f"invalid configuration: {_first_error(e, cls)}") from None


def dump_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def secret_fields(model: type[BaseModel]) -> set[str]:
    """Fields marked secret (a token, an API key): never printed, logged or written with the config."""
    return {name for name, field in model.model_fields.items()
            if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("secret")}


def changed(cfg: BaseModel) -> dict[str, Any]:
    """The options that differ from their defaults (what a run prints; the whole config goes to its folder); a
    secret's value shows as ***."""
    hidden = secret_fields(type(cfg))
    return {name: "***" if name in hidden else getattr(cfg, name) for name, field in type(cfg).model_fields.items()
            if field.is_required() or getattr(cfg, name) != _default(field)}

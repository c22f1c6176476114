"""Command-line flags generated from config dataclasses, so options never drift from the code."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing


def _base_type(annotation):
    if isinstance(annotation, str):
        annotation = eval(annotation, {"int": int, "str": str, "bool": bool, "float": float})
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def add_dataclass_args(parser: argparse.ArgumentParser, cls, title: str,
                       skip: tuple[str, ...] = ()) -> None:
    """One flag per field: `--field-name`, typed, with the field's help text and choices."""
    group = parser.add_argument_group(title)
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flags = ["--" + field.name.replace("_", "-"), *field.metadata.get("aliases", [])]
        help_text = field.metadata.get("help", "")
        kind = _base_type(field.type)
        if kind is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction,
                               default=field.default, help=help_text)
            continue
        if field.metadata.get("multiple"):
            group.add_argument(*flags, action=_AppendNames, default=field.default,
                               nargs=field.metadata.get("nargs"), help=help_text)
            continue
        group.add_argument(*flags, type=kind, default=field.default,
                           choices=field.metadata.get("choices"),
                           help=f"{help_text} (default: {field.default})")


class _AppendNames(argparse.Action):
    """A repeatable flag whose values may also be comma-separated (or, with nargs="+",
    space-separated): a tuple of them all. A JSON object value is one item, commas and all."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = ()
        for value in [values] if isinstance(values, str) else values:
            if value.lstrip().startswith("{"):
                names += (value.strip(),)
            else:
                names += tuple(name.strip() for name in value.split(",") if name.strip())
        setattr(namespace, self.dest, tuple(getattr(namespace, self.dest) or ()) + names)


def dataclass_from_args(cls, args: argparse.Namespace):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine_config import EngineConfig

    add_dataclass_args(parser, EngineConfig, "engine")


def engine_config_from_args(args: argparse.Namespace):
    from kvserve.engine_config import EngineConfig

    return dataclass_from_args(EngineConfig, args)

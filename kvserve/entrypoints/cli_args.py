"""Command-line flags generated from the EngineConfig dataclass, so options never drift."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from kvserve.engine_config import EngineConfig


def _base_type(annotation):
    if isinstance(annotation, str):
        annotation = eval(annotation, {"int": int, "str": str, "bool": bool, "float": float})
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = field.metadata.get("help", "")
        kind = _base_type(field.type)
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                               help=help_text)
            continue
        group.add_argument(flag, type=kind, default=field.default,
                           choices=field.metadata.get("choices"),
                           help=f"{help_text} (default: {field.default})")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})

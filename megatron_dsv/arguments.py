"""Command-line flags: ``add_dsv_args`` is a Megatron ``extra_args_provider``.

``--use-dsv-attention`` turns DSV on; every ``DSVConfig`` field becomes one
``--dsv-<field-with-dashes>`` flag whose default and help come from the
dataclass, so flags and config cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Optional

from megatron_dsv.config import DSVConfig

__all__ = ["add_dsv_args", "dsv_config_from_args", "flag_name", "name_flags"]


def flag_name(field_name: str) -> str:
    """'predictor_rank' -> '--dsv-predictor-rank'."""
    return "--dsv-" + field_name.replace("_", "-")


_FIELDS = frozenset(f.name for f in dataclasses.fields(DSVConfig))


def name_flags(message: str) -> str:
    """A DSVConfig error as the user typed it: 'DSVConfig.theta must be ...' -> '--dsv-theta must be ...'.

    ``DSVConfig.<field>`` and bare multi-word field names ('stage_switch_rule') become their flags."""
    def flag(match):
        return flag_name(match.group(1)) if match.group(1) in _FIELDS else match.group(0)

    message = re.sub(r"DSVConfig\.(\w+)", flag, message)
    return re.sub(r"\b([a-z]+(?:_[a-z0-9]+)+)\b", flag, message)


def _base_type(tp):
    """int for int / Optional[int], etc."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _none_or(conv):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else conv(text)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


class _OptionalTriple(argparse.Action):
    """``--flag T H W`` -> (T, H, W) ints; ``--flag auto`` -> None (the field's automatic choice)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if len(values) == 1 and values[0].lower() == "auto":  # not 'none': it reads as "off", which is 0 0 0
            setattr(namespace, self.dest, None)
            return
        try:
            triple = tuple(int(v) for v in values)
        except ValueError:
            triple = ()
        if len(triple) != 3:
            parser.error(f"{option_string} takes three ints T H W or 'auto', got {' '.join(values)!r}")
        setattr(namespace, self.dest, triple)


def add_dsv_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--use-dsv-attention`` and the ``--dsv-*`` flags; returns the parser (Megatron's contract)."""
    group = parser.add_argument_group(title="DSV sparse attention")
    group.add_argument("--use-dsv-attention", action="store_true",
                       help="Replace core attention with DSV dynamic sparse attention.")
    hints = typing.get_type_hints(DSVConfig)
    for f in dataclasses.fields(DSVConfig):
        tp = hints[f.name]
        # %(default)s: argparse prints the parser's default, so a trainer's own defaults (set_defaults) show
        help_text = f.metadata.get("help", "").replace("%", "%%") + " (default: %(default)s)"
        kwargs = dict(dest="dsv_" + f.name, default=f.default, help=help_text)
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        if typing.get_origin(tp) is tuple:  # (t, h, w) triples
            kwargs.update(nargs=len(typing.get_args(tp)), type=int, metavar=("T", "H", "W"))
        elif typing.get_origin(_base_type(tp)) is tuple:  # Optional triples: T H W, or 'auto' for None
            kwargs.update(nargs="+", action=_OptionalTriple, metavar="R")
        else:
            base = _base_type(tp)
            optional = base is not tp
            kwargs["type"] = _none_or(base) if optional else base
        group.add_argument(flag_name(f.name), **kwargs)
    return parser


def dsv_config_from_args(args: argparse.Namespace) -> Optional[DSVConfig]:
    """DSVConfig from parsed args, or None when ``--use-dsv-attention`` is off.

    An invalid value raises ``ValueError`` naming the ``--dsv-*`` flag (not the DSVConfig field)."""
    if not getattr(args, "use_dsv_attention", False):
        return None
    values = {}
    for f in dataclasses.fields(DSVConfig):
        key = "dsv_" + f.name
        if not hasattr(args, key):
            raise ValueError(f"args has no {key!r}: was add_dsv_args passed as extra_args_provider?")
        values[f.name] = getattr(args, key)
    try:
        return DSVConfig(**values)
    except ValueError as err:
        raise ValueError(name_flags(str(err))) from None

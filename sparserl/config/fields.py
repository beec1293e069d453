"""How a config field is declared and how one group of fields is checked: the leaf of the config package.

Every field of the schema (sparserl/config/schema.py) and of the library's own config groups (`KVPolicyConfig`,
`BudgetControlConfig` in sparserl/kv/, `CorrectionConfig` in sparserl/algo/) is declared with
`opt(default, help, choices=..., rule=...)`: its `--help` text, and its rule, live in the field's metadata:
- an enum's valid names (`choices`; `more`: a function returning names registered at run time that pass too);
- any other rule (`rule`): a `Rule` built from the words below (`at_least(1)`, `within("(0, 1]")`, `NON_EMPTY`,
  `each(...)`, `or_null(...)`), whose wording (`> 0`, `in [0, 1)`) `--help` and docs/config.md print as well.
A rule that relates two keys of one group is a function `fn(node, prefix)` in the group class's `RELATIONS`
(a ClassVar); rules across groups are sparserl/config/relations.py's.

`check_section(prefix, node)` checks one group: its field types, its rules, then its `RELATIONS`. The groups that
library code builds on its own call it from `__post_init__`, so a bad value raises there the same error as on the
command line: one `ConfigError` (a `UserError`, printed by the entry points as one `error:` line, and a
`ValueError` for library callers) naming the key, the value and what is valid.

This module imports nothing of sparserl but `utils.errors`, so sparserl/kv and sparserl/algo declare their groups
with it without importing the schema that holds them. Plain Python: no torch.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from sparserl.utils.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value outside its rule: one line naming the key, the value and what is valid."""


@dataclass(frozen=True)
class Rule:
    test: Callable[[Any], bool]
    desc: str  # completes "must be ..."
    names: tuple[str, ...] = ()  # the valid names of an enum (--help omits `desc` where the help text lists them)
    more: Callable[[], tuple[str, ...]] | None = None  # names registered at run time that pass as well

    def ok(self, value: Any) -> bool:
        return self.test(value) or (self.more is not None and isinstance(value, str) and value in self.more())

    def describe(self) -> str:
        extra = [n for n in (self.more() if self.more else ()) if n not in self.names]
        return f"one of {', '.join((*self.names, *extra))}" if extra else self.desc


def opt(default: Any, help: str = "", *, choices: Iterable[str] = (), choices_desc: str = "",
        more: Callable[[], tuple[str, ...]] | None = None, rule: Rule | None = None) -> Any:
    """A schema field: its default, its `--help` text and its rule: for an enum, its valid names (`choices`, worded
    as `choices_desc` where "one of a, b, c" would not read well; `more`: names registered at run time), else a
    `rule`. A mutable default (a list, a dict, a dataclass instance) is copied for every instance; a dataclass type
    is instantiated."""
    metadata: dict[str, Any] = {"help": help}
    if choices:
        metadata["choices"] = tuple(choices)
        if choices_desc:
            metadata["choices_desc"] = choices_desc
        if more is not None:
            metadata["more"] = more
    if rule is not None:
        metadata["rule"] = rule
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=default, metadata=metadata)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def at_least(lo: float) -> Rule:
    return Rule(lambda v: _finite(v) and v >= lo, f">= {lo}")


def above(lo: float) -> Rule:
    return Rule(lambda v: _finite(v) and v > lo, f"> {lo}")


def within(interval: str) -> Rule:
    """`within("(0, 1]")`: brackets say closed, parentheses open."""
    lo_s, hi_s = interval[1:-1].split(",")
    lo, hi, lo_open, hi_open = float(lo_s), float(hi_s), interval[0] == "(", interval[-1] == ")"
    return Rule(lambda v: _finite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi),
                f"in {interval}")


def one_of(*names: str, desc: str = "", more: Callable[[], tuple[str, ...]] | None = None) -> Rule:
    return Rule(lambda v: isinstance(v, str) and v in names, desc or f"one of {', '.join(names)}", names, more)


def or_null(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.test(v), f"{rule.desc}, or null (off)")


def each(rule: Rule, length: int | None = None, min_len: int = 0) -> Rule:
    size = f"{length} values" if length is not None else ("a non-empty list" if min_len else "a list")
    return Rule(lambda v: isinstance(v, (list, tuple)) and (len(v) == length if length is not None else len(v) >= min_len)
                and all(rule.test(x) for x in v), f"{size}, each {rule.desc}")


NON_EMPTY = Rule(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
ODD = Rule(lambda v: _finite(v) and v >= 1 and v % 2 == 1, "an odd integer >= 1 (even kernels shift the pooled scores)")
COUNT, NON_NEG, PROB = at_least(1), at_least(0), within("[0, 1]")


def rule_of(f: dataclasses.Field, hint: Any = None) -> Rule | None:
    """The rule of field `f` (annotated `hint`): its declared `rule`, else its declared enum names (each element
    of a list field must be one of them), else None (any value of its type)."""
    if "rule" in f.metadata:
        return f.metadata["rule"]
    names = f.metadata.get("choices")
    if not names:
        return None
    rule = one_of(*names, desc=f.metadata.get("choices_desc", ""), more=f.metadata.get("more"))
    return each(rule) if typing.get_origin(hint) is list else rule


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of dataclass `cls`."""
    return typing.get_type_hints(cls)


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        return isinstance(value, (list, tuple))
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    name = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(hint)
    return name or {list: "a list", dict: "a map"}.get(typing.get_origin(hint), str(hint))


def show(value: Any) -> str:
    """A value as it would be written on the command line."""
    if isinstance(value, str):
        return value if value else "''"
    return json.dumps(value) if isinstance(value, (list, tuple, bool)) or value is None else str(value)


def ordered(node: Any, prefix: str, lo: str, hi: str) -> None:
    """A relation: `prefix.lo` <= `prefix.hi` where both are set."""
    a, b = getattr(node, lo), getattr(node, hi)
    if a is not None and b is not None and a > b:
        raise ConfigError(f"{prefix}.{lo}={show(a)} must be <= {prefix}.{hi}={show(b)}")


def check_section(prefix: str, node: Any) -> None:
    """Raise a ConfigError for the first leaf of dataclass `node` (the group at dotted `prefix`) of the wrong type
    or outside its rule, then for the first failed relation of its class's `RELATIONS`. Nested groups are not
    visited (sparserl/config/checks.py `check_config` visits every group)."""
    types_ = hints(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        hint = types_.get(f.name)
        if hint is not None and not _type_ok(value, hint):
            raise ConfigError(f"{key}={show(value)}: must be {_type_name(hint)}")
        rule = rule_of(f, hint)
        if rule is not None and not rule.ok(value):
            finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
            raise ConfigError(f"{key}={show(value)}: must be {finite}{rule.describe()}")
    for relation in getattr(type(node), "RELATIONS", ()):
        relation(node, prefix)

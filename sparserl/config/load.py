"""Loading a run's configuration: `load_config(overrides)` composes `configs/<name>.yaml` over the schema
(sparserl/config/schema.py) with command-line overrides (`key=value`, `+preset=sparse_rl`), checks every overridden key
against the schema first (a misspelled key fails naming the closest valid names; a key that was renamed or folded
into another, `RENAMED`, fails naming its replacement; a value of the wrong type fails naming the type the key
wants, with its default as an example), checks every value (sparserl/config/checks.py), and
returns the typed `Config`. Nothing past this module sees a DictConfig. This module imports no torch.
"""
from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

from sparserl.config.schema import CONFIG_DIR, Config
from sparserl.config.checks import check_config
from sparserl.utils.errors import UserError


# Keys that are gone, with the key that replaced each: setting one (command line or YAML) fails naming it.
RENAMED: dict[str, tuple[str, str]] = {  # old key: (new key, why)
    "rollout.sglang.dtype": ("rollout.dtype", "it sets both engines"),
    "rollout.sglang.release_weights": ("rollout.release_weights", "it sets both engines"),
    "rollout.sglang.max_total_tokens": ("rollout.kv_pool_tokens", "it sets both engines"),
    "rollout.sglang.max_running_requests": ("rollout.max_num_seqs", "it sets both engines"),
}


def renamed_error(key: str) -> UserError:
    new, why = RENAMED[key]
    return UserError(f"{key} was folded into {new} ({why}); use {new}=...")


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from hydra.core.config_store import ConfigStore

        ConfigStore.instance().store(name="sparserl_schema", node=Config)
        _registered = True


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def field_type(cls: type, name: str) -> Any:
    """The resolved annotation of field `name` of dataclass `cls`."""
    return typing.get_type_hints(cls)[name]


def group_type(cls: type, name: str) -> type | None:
    """The dataclass of field `name` of `cls` when that field is a group, else None."""
    hint = field_type(cls, name)
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def leaf_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every settable key of the schema (a free-form map such as env.openreward.envs is one key), in field order."""
    out: list[str] = []
    for f in dataclasses.fields(cls):
        key, sub = f"{prefix}{f.name}", group_type(cls, f.name)
        out += leaf_keys(sub, f"{key}.") if sub is not None else [key]
    return out


def check_key(key: str) -> None:
    """Raise UserError naming the replacement of a renamed key, or the closest valid keys when `key` (dotted) is
    not in the schema."""
    if key in RENAMED:
        raise renamed_error(key)
    node: type | None = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = _fields(node)
        if part not in fields:
            prefix = ".".join(parts[:i])
            valid = [f"{prefix}.{n}" if prefix else n for n in fields]
            close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5) or difflib.get_close_matches(part, list(fields), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UserError(f"unknown config key {key!r}{hint} (valid under {prefix or 'the root'}: {', '.join(fields)})")
        sub = group_type(node, part)
        if sub is None and i < len(parts) - 1:
            if typing.get_origin(field_type(node, part)) is dict:  # a free-form map: its entries are checked with the loaded config (checks.py)
                path = ".".join(parts[: i + 1])
                raise UserError(f"unknown config key {key!r}: {path} is a map; give its entries as one value, "
                                f"{path}={{name: {{key: value}}}}")
            raise UserError(f"unknown config key {key!r}: {'.'.join(parts[: i + 1])} has no sub-keys")
        node = sub


def _is_map(key: str) -> bool:
    """Whether `key` is a free-form map of the schema (`dict` field), which Hydra's struct mode would refuse to extend."""
    node: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is None or part not in _fields(node):
            return False
        if i == len(parts) - 1:
            return typing.get_origin(field_type(node, part)) is dict
        node = group_type(node, part)
    return False


def _override_key(override: str) -> str | None:
    if "=" not in override:
        raise UserError(f"bad override {override!r}: write key=value")
    key = override.split("=", 1)[0].lstrip("+~")
    if key in ("preset", "hydra") or key.startswith("hydra."):
        return None
    return key


def _renamed_in(exc: BaseException) -> str | None:
    """The renamed key a config file set, when that is what composing failed on."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        key = getattr(exc, "full_key", None)
        if key in RENAMED:
            return key
        exc = exc.__cause__ or exc.__context__
    return None


def _kind(hint: Any) -> str:
    """What a value of annotation `hint` is, in words: 'an integer', 'a list of numbers', ..."""
    words = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "true/false values"),
             str: ("a string", "strings")}
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (list, tuple):
        inner = words.get(args[0], ("", "values"))[1] if args else "values"
        return f"a list of {inner}"
    if typing.get_origin(hint) is dict:
        return "a map {key: value}"
    if len(args) == 1 and len(typing.get_args(hint)) == 2:  # X | None
        return f"{_kind(args[0])} or null"
    return words.get(hint, (getattr(hint, "__name__", str(hint)),))[0]


def _example(value: Any, hint: Any) -> str:
    """`value` (a key's default) as the command line writes it; an empty list gets two made-up items of its type."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        if not value:
            inner = (typing.get_args(hint) or (str,))[0]
            return {int: "[1,2]", float: "[0.5,1.0]"}.get(inner, "[a,b]")
        return "[" + ",".join(_example(v, None) for v in value) + "]"
    return "null" if value is None else str(value)


def _wrong_type(exc: BaseException, overrides: list[str]) -> str | None:
    """The line for a value of the wrong type (omegaconf's ValidationError on a schema key), naming the type the key
    wants and its default as an example; None when composing failed for another reason."""
    from omegaconf.errors import ValidationError

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        key = getattr(exc, "full_key", None)
        if isinstance(exc, ValidationError) and isinstance(key, str) and key:
            key = key.split("[", 1)[0]
            break
        exc = exc.__cause__ or exc.__context__
    else:
        return None
    node: Any = Config
    default = Config()
    *groups, name = key.split(".")
    for part in groups:
        if node is None or part not in _fields(node):
            return None
        node, default = group_type(node, part), getattr(default, part)
    if node is None or name not in _fields(node):
        return None
    hint = field_type(node, name)
    given = next((ov.lstrip("+~") for ov in overrides if ov.lstrip("+~").split("=", 1)[0] == key), None)
    where = f"{given}: {key}" if given else f"{key} (set in a config file)"
    return f"{where} wants {_kind(hint)}, e.g. {key}={_example(getattr(default, name), hint)}"


def load_config(overrides: list[str] | None = None, config_name: str = "grpo", config_dir: Path | None = None) -> Config:
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    overrides = list(overrides or [])
    for i, ov in enumerate(overrides):
        key = _override_key(ov)
        if key is not None:
            check_key(key)
            if _is_map(key) and not ov.startswith(("+", "~")):  # a map's entries add to those of the config files
                overrides[i] = "++" + ov
    _register()
    config_dir = Path(config_dir or CONFIG_DIR)
    if not config_dir.exists():
        raise UserError(f"config folder {config_dir} not found (install sparserl with pip install -e .)")
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
        obj = OmegaConf.to_object(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        old = _renamed_in(e)
        if old is not None:
            raise renamed_error(old) from None
        wrong = _wrong_type(e, overrides)
        if wrong is not None:
            raise UserError(wrong) from None
        raise UserError(" ".join(str(e).split())) from None
    assert isinstance(obj, Config)
    check_config(obj)
    return obj

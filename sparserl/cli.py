"""The command line of every entry point: `key=value` overrides, `+preset=NAME`, `--config-name NAME`,
`--help` and `--cfg job`.

`parse_cli(argv, config_name)` returns the loaded, range-checked `Config`, or None after it answered
`--help` / `-h` (every key with its value and its description) or `--cfg job` (the resolved config as YAML);
the caller then exits 0. Under torchrun only rank 0 prints. `--config-name NAME` (or `-cn NAME`) starts from
configs/NAME.yaml instead of the entry point's own base config (grpo for training, eval for evaluation), e.g.
`--config-name gpu` for the paper's GPU settings. Anything else that starts with `-` is a UserError. The help
text is generated: keys and values from the dataclasses of `sparserl/config/schema.py` and the loaded config,
descriptions from each field's `help` metadata (`opt(default, help)`; a group's from the field holding it),
valid values from `sparserl.config.checks.RULES`. A key without help is listed without a description.
`sections()` is that text as data; scripts/gen_reference.py renders docs/config.md from it.

Left out on purpose: the rest of Hydra's command line (`--multirun`, `--cfg hydra`, `--config-path`, tab
completion, `hydra.*` run directories): a run writes to `trainer.output_dir` and nowhere else.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

from sparserl.config.checks import RULES
from sparserl.config.fields import show
from sparserl.config.load import load_config
from sparserl.config.schema import CONFIG_DIR, Config, base_configs, to_yaml
from sparserl.utils.errors import UserError, run_main

KEY_WIDTH = 44  # "  key = value" is padded to this many characters before the description


def run_entry(train: Callable[[Config], None], argv: list[str] | None = None) -> None:
    """A trainer's `main`: the config from `argv` (default the process's own arguments), then `train(cfg)`, unless
    `--help` or `--cfg job` was answered; user errors end as one line (`utils.errors.run_main`)."""
    def run() -> None:
        cfg = parse_cli(sys.argv[1:] if argv is None else argv, "grpo")
        if cfg is not None:
            train(cfg)

    run_main(run)


def parse_cli(argv: list[str], config_name: str = "grpo") -> Config | None:
    """Overrides and options -> the Config, or None once `--help` or `--cfg job` has been answered."""
    overrides, want_help, want_cfg = [], False, False
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            want_help = True
        elif arg in ("--config-name", "-cn") or arg.startswith("--config-name="):
            name = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else "")
            if name.removesuffix(".yaml") not in base_configs():
                raise UserError(f"--config-name {name or '(nothing)'}: no such base config; "
                                f"the base configs are {', '.join(base_configs())} (configs/NAME.yaml)")
            config_name = name.removesuffix(".yaml")
        elif arg in ("--cfg", "-c") or arg.startswith("--cfg="):
            what = arg.split("=", 1)[1] if "=" in arg else (args.pop(0) if args else "")
            if what != "job":
                raise UserError(f"--cfg {what or '(nothing)'}: only --cfg job is supported (the resolved run config)")
            want_cfg = True
        elif arg.startswith("-"):
            raise UserError(f"unknown option {arg!r}: the options are --help, --cfg job and --config-name NAME; "
                            "settings are key=value")
        else:
            overrides.append(arg)
    if want_help:
        _print(help_text(config_name, overrides))
        return None
    cfg = load_config(overrides, config_name=config_name)
    if want_cfg:
        _print(to_yaml(cfg).rstrip())
        return None
    return cfg


def _print(text: str) -> None:
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        print(text, flush=True)
    except BrokenPipeError:  # `--help | head`: the reader left; say nothing more, not even at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def help_text(config_name: str = "grpo", overrides: list[str] | None = None) -> str:
    cfg = load_config(overrides, config_name=config_name)
    prog = _prog()
    presets = sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml"))
    lines = [
        f"usage: python -m {prog} [key=value ...] [+preset=NAME] [--config-name NAME] [--cfg job] [-h]",
        "",
        f"Every key below is set with key=value; the values shown are configs/{config_name}.yaml's"
        f"{' with the overrides given' if overrides else ''}.",
        f"+preset=NAME applies configs/preset/NAME.yaml ({', '.join(presets)}); later overrides still apply.",
        f"--config-name NAME starts from configs/NAME.yaml ({', '.join(base_configs())}) instead.",
        "--cfg job prints the resolved config as YAML and exits. A bad key, value, data file or output folder",
        "stops the run before any work with one line `error: ...` on stderr and exit code 2.",
    ]
    for section in sections(cfg):
        if section.key:
            lines += ["", f"{section.key}:" + (f"  {section.doc}" if section.doc else "")]
        for k in section.keys:
            entry = f"  {k.key} = {show(k.value)}"
            lines.append(f"{entry:<{KEY_WIDTH}} {k.help}".rstrip() if len(entry) < KEY_WIDTH else f"{entry}  {k.help}".rstrip())
    return "\n".join(lines)


def _prog() -> str:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or "sparserl.trainer.grpo"
    return name.removesuffix(".__main__")


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted name, as set on the command line
    type: str  # the field's annotation in its dataclass
    value: Any  # its value in the loaded config
    help: str  # the field's help, with RULES's valid values where the help does not list them


@dataclasses.dataclass(frozen=True)
class Section:
    key: str  # the group's dotted name; '' for the root
    doc: str  # the help of the field holding the group, if it has one
    keys: tuple[KeyDoc, ...]


def sections(cfg: Config) -> list[Section]:
    """Every group of `cfg` in `--help`'s order (a group's own keys, then its nested groups, in field order)."""
    out: list[Section] = []
    _walk(cfg, "", "", out)
    return out


def _walk(node, key: str, doc: str, out: list[Section]) -> None:
    keys, groups = [], []
    for f in dataclasses.fields(node):
        value, name = getattr(node, f.name), f"{key}.{f.name}" if key else f.name
        text = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            groups.append((name, value, text))
            continue
        rule = RULES.get(name)
        if rule is not None and not (rule.names and all(n in text for n in rule.names)):
            text = f"{text} [{rule.desc}]" if text else f"[{rule.desc}]"
        keys.append(KeyDoc(name, str(f.type), value, text))
    out.append(Section(key, doc, tuple(keys)))
    for name, value, text in groups:
        _walk(value, name, text, out)

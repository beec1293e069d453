"""What `python -m sparserl.eval` takes from the training run it evaluates, so that a run is evaluated as it sampled.

When `model.path` is a training run's folder (a `trainer.output_dir` holding `config.yaml`), its exported `hf/`, or
one of its `checkpoints/step_N/`, the evaluation samples with the run's length cap (its `rollout.max_new_tokens`
becomes `eval.max_new_tokens`) and its KV settings (every `rollout.kv.*` key, the compression algorithm included,
so a sparse run is evaluated under its own compression; `rollout.kv.algorithm=none` evaluates dense and takes no
other `rollout.kv.*` key of the run's). A key the command line sets, as `key=value` or through a `+preset=NAME`
that sets it, keeps the command line's value; the base config (`--config-name`) does not count. `take_run_settings`
returns the config and the lines `python -m sparserl.eval` prints first: what it took from the run's config, and
which keys the command line set over the run's values. Any other model path (a Hugging Face folder or hub id, a
LoRA adapter folder outside a run) is evaluated with the config as loaded. An SFT run's folder is not a run that
sampled: its config.yaml has the same keys, but its `rollout.*` values were never used, so nothing is taken from it
(the first line of the file says it is an SFT run's). A run with `rollout.kv.budget=auto` is evaluated at the budget
its controller had reached, saved with the checkpoint (`controller_budget`), and the number is what eval.json
records.

Left out on purpose: taking other sampling keys (the run's `rollout.temperature`, `top_p`, `stop_strings`; eval
has its own `eval.temperature` and `eval.top_p`), and showing the taken values in `--help` or `--cfg job`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from sparserl.config import CONFIG_DIR, SFT_CONFIG_HEADER, Config
from sparserl.config.schema import DPO_CONFIG_HEADER
from sparserl.config.checks import check_config
from sparserl.config.load import leaf_keys
from sparserl.kv.policy import KVPolicyConfig
from sparserl.utils.errors import UserError

LENGTH_CAP = ("rollout.max_new_tokens", "eval.max_new_tokens")  # (the run's key, the key eval samples with)


def run_keys() -> list[tuple[str, str]]:
    """(the run's key, eval's key) for everything taken from a run's config."""
    return [LENGTH_CAP, *((f"rollout.kv.{k}", f"rollout.kv.{k}") for k in leaf_keys(KVPolicyConfig))]


def run_folder(path: str) -> Path | None:
    """The training run `model.path` belongs to (the folder with its config.yaml), else None."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None
    for run in (p, p.parent if p.name == "hf" else None,
                p.parent.parent if (p / "COMPLETE").exists() and p.parent.name == "checkpoints" else None):
        if run is not None and (run / "config.yaml").is_file():
            return run
    return None


def command_line_keys(argv: list[str]) -> set[str]:
    """The config keys the command line sets: each `key=value`'s key and every key of each `+preset=NAME`."""
    from omegaconf import OmegaConf

    keys: set[str] = set()
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("--config-name", "-cn", "--cfg", "-c"):
            args = args[1:]  # the option's value
            continue
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if key == "preset":
            preset = CONFIG_DIR / "preset" / f"{value.removesuffix('.yaml')}.yaml"
            if preset.is_file():
                node = OmegaConf.to_container(OmegaConf.load(preset))
                keys |= set(_flatten(node))
        else:
            keys.add(key)
    return keys


def _flatten(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix]
    out: list[str] = []
    for k, v in node.items():
        if prefix or k != "defaults":
            out += _flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else [f"{prefix}{k}"]
    return out


def _set_by(key: str, given: set[str]) -> bool:
    """Whether a command-line key sets `key`: the key itself, or a group above it (`rollout.kv={...}`)."""
    return any(key == g or key.startswith(g + ".") for g in given)


def _get(cfg: Config, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def take_run_settings(cfg: Config, argv: list[str]) -> tuple[Config, list[str]]:
    """`cfg` with the run's length cap and KV settings where `model.path` is a run's and the command line (`argv`)
    does not set them, and the lines saying so (none for a model of no run)."""
    run = run_folder(cfg.model.path)
    if run is None:
        return cfg, []
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    source = run / "config.yaml"
    try:
        run_cfg = OmegaConf.load(source)
    except (OmegaConfBaseException, ValueError, OSError) as e:
        why = " ".join(str(e).split())
        raise UserError(f"model.path={cfg.model.path}: cannot read the run's config {source}: {why}") from None
    kind = {SFT_CONFIG_HEADER: "an SFT", DPO_CONFIG_HEADER: "a DPO"}.get(source.read_text().split("\n", 1)[0] + "\n")
    if kind is not None:
        return cfg, [f"eval: {source} is {kind} run's config: it sampled nothing, so eval takes no setting from it "
                     f"(eval.max_new_tokens={cfg.eval.max_new_tokens}, rollout.kv.algorithm={cfg.rollout.kv.algorithm})"]
    given = command_line_keys(argv)
    taken: dict[str, Any] = {}  # eval's key: the run's value
    kept: dict[str, Any] = {}  # eval's key: the run's value, where the command line set the key
    for theirs, ours in run_keys():
        if not _has(run_cfg, theirs):
            continue  # a key the run's (older) config does not have: eval's value stands
        (kept if _set_by(ours, given) else taken)[ours] = OmegaConf.select(run_cfg, theirs)
    dense = "rollout.kv.algorithm" in kept and cfg.rollout.kv.algorithm == "none"
    if dense:  # the command line asks for a dense evaluation: the run's other KV settings do not apply
        taken = {k: v for k, v in taken.items() if not k.startswith("rollout.kv.")}
        kept = {k: v for k, v in kept.items() if k == "rollout.kv.algorithm" or not k.startswith("rollout.kv.")}
    budget_line = None
    if taken.get("rollout.kv.budget") == "auto":  # the number the run's controller had reached, not its ceiling
        taken["rollout.kv.budget"], budget_line = controller_budget(cfg.model.path, run, run_cfg)
    new = _apply(cfg, taken, source)
    always = (LENGTH_CAP[1], "rollout.kv.algorithm")
    changed = [k for k in taken if k in always or _get(new, k) != _get(cfg, k)]
    same = sum(k.startswith("rollout.kv.") for k in taken) - sum(k.startswith("rollout.kv.") for k in changed)
    items = [f"{k}={_show(_get(new, k))}" + (f" (its {LENGTH_CAP[0]})" if k == LENGTH_CAP[1] else "") for k in changed]
    lines = []
    if taken:
        note = f"its {same} other rollout.kv.* key(s) equal eval's" if same else ""
        lines.append(f"eval: from the run's config {source}: " + "; ".join(x for x in (", ".join(items), note) if x))
    if budget_line:
        lines.append(budget_line)
    kept = {k: v for k, v in kept.items() if k in given or _get(new, k) != v}  # a group set whole: what differs
    if kept:
        lines.append("eval: set on the command line over the run's: "
                     + ", ".join(f"{k}={_show(_get(new, k))} (the run's: {_show(v)})" for k, v in kept.items())
                     + ("; dense, so the run's other rollout.kv.* keys are not taken" if dense else ""))
    return new, lines


def controller_budget(model_path: str, run: Path, run_cfg) -> tuple[int, str]:
    """A `rollout.kv.budget=auto` run's budget for the evaluated weights, and the line that says where it came from:
    the controller's budget saved with the checkpoint (`kv_budget` in its trainer_state.pt; the budget the run's own
    evaluation during training used at that step), that of `model.path` when it is a checkpoint, else of the run's
    last checkpoint (the one its `hf/` was exported after); without one, the controller's ceiling."""
    from sparserl.actor import checkpoint

    p = Path(model_path).expanduser()
    ckpt = p if (p / "COMPLETE").exists() else checkpoint.latest(run)
    state = checkpoint.read_state(ckpt) if ckpt is not None else {}
    saved = state.get("kv_budget")
    if saved is not None:
        budget = int(saved["budget"])
        return budget, (f"eval: rollout.kv.budget=auto in the run: {budget}, its budget controller's at step "
                        f"{state.get('step', '?')} (saved in {ckpt / checkpoint.STATE_FILE})")
    from omegaconf import OmegaConf

    ceiling = int(OmegaConf.select(run_cfg, "rollout.kv.control.ceiling"))
    where = f"{ckpt} holds no budget controller state" if ckpt is not None else f"{run} has no complete checkpoint"
    return ceiling, f"eval: rollout.kv.budget=auto in the run, and {where}: the controller's ceiling {ceiling}"


def _has(node: Any, key: str) -> bool:
    from omegaconf import OmegaConf

    *parents, last = key.split(".")
    parent = OmegaConf.select(node, ".".join(parents)) if parents else node
    return parent is not None and OmegaConf.is_dict(parent) and last in parent


def _apply(cfg: Config, values: dict[str, Any], source: Path) -> Config:
    """`cfg` with `values` (dotted keys), typed and checked as a loaded config is."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = OmegaConf.structured(cfg)
    try:
        for key, value in values.items():
            OmegaConf.update(node, key, value, merge=False)
        new = OmegaConf.to_object(node)
    except (OmegaConfBaseException, ValueError) as e:
        raise UserError(f"model.path={cfg.model.path}: the run's config {source}: {' '.join(str(e).split())}") from None
    assert isinstance(new, Config)
    try:
        check_config(new)
    except UserError as e:
        raise UserError(f"model.path={cfg.model.path}: with the settings of the run's config {source}: {e}") from None
    return new

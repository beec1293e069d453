"""Evaluation sets: `eval.datasets` entries -> checked `EvalSet`s (rows read, env loaded) before any output.

An entry is the name of a shared eval set (`SHARED`: the files of sparserl/data/eval, package data, with their
fields, the math env and a boxed-answer instruction), `env` (held-out prompts of the training env, below), or a
mapping `{name, path, prompt_key, answer_key, answer_extract, env, suffix, generate}`; a mapping whose name is a
shared set (or `env`) starts from that set's values.

`env`: the task a run trains on, asked afresh: `make_prompts(n, seed)` of `env.path` (the run's env; evaluating a
run folder takes its env.path, eval/__main__.py), `eval.limit` rows (`GENERATED` when 0), with a seed derived from
`eval.seed` that no training run uses unless its `trainer.seed` is that very number. A task with few distinct
prompts (envs/arithmetic.py has 81) asks again prompts a run trained on: the set then measures the task, not
generalization. A mapping with `generate: N` makes N rows the same way from its own `env`. A name is
read from the package's copy unless `eval.data_dir` names another folder, so a clone or an installed wheel
needs nothing beside it; a `path` is used as given (relative to the current folder). `eval.limit` keeps the
first rows of each file (the same rows for every run, so numbers compare across models and settings).

Every mistake is a `UserError` naming the entry: unknown name or field, missing file, a prompt key no row
has, an answer key no row has, k outside [1, n].
Left out on purpose: hub downloads, per-set sampling settings (one `eval.*` for all sets), shuffling.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparserl.config import EvalConfig
from sparserl.data.dataset import ANSWER_EXTRACTORS, PromptRow, load_prompts, rows_from_records
from sparserl.utils.envload import EnvModule, load_env
from sparserl.utils.errors import UserError
from sparserl.utils.seed import derive

# The shared sets ship with the package (setup.py package_data; provenance in its README.md).
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "eval"
# The instruction of the Qwen2.5-Math chain-of-thought prompt, which the Sparse-RL evaluation suite uses.
BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass
class EvalSetSpec:
    name: str
    path: str = ""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    answer_extract: str = "none"
    env: str = "envs/math.py"
    suffix: str = ""  # appended to the user message (see data.dataset.format_prompt)
    generate: int = 0  # > 0: rows from the env's make_prompts(generate, held-out seed) instead of a file


def _shared(name: str, file: str, prompt_key: str, answer_key: str, extract: str = "none") -> EvalSetSpec:
    return EvalSetSpec(name, file, prompt_key, answer_key, extract, "envs/math.py", BOXED_SUFFIX)


SHARED: dict[str, EvalSetSpec] = {s.name: s for s in (
    _shared("gsm8k", "gsm8k.jsonl", "question", "answer", "gsm8k_hash"),
    _shared("math500", "math500.jsonl", "problem", "answer"),
    _shared("aime24", "aime24.jsonl", "problem", "answer"),
    _shared("amc23", "amc23.jsonl", "problem", "answer"),
    _shared("minerva", "minerva_math.jsonl", "problem", "solution", "boxed"),
    _shared("olympiadbench", "olympiadbench.jsonl", "question", "final_answer"),
    _shared("gaokao2023en", "gaokao2023en.jsonl", "question", "answer"),
    _shared("mawps", "mawps.jsonl", "input", "target"),
)}


ENV_SET = "env"  # the training env's own prompts
GENERATED = 256  # rows of a generated set when eval.limit is 0
HELD_OUT = 1_000_000_007  # the key of a generated set's seed under eval.seed (utils.seed.derive)


@dataclass
class EvalSet:
    spec: EvalSetSpec
    rows: list[PromptRow]
    env: EnvModule

    @property
    def name(self) -> str:
        return self.spec.name


def resolve_spec(entry: Any, i: int, data_dir: Path, env_path: str = "envs/arithmetic.py") -> EvalSetSpec:
    """`env_path`: the env the `env` set asks (the run's env.path)."""
    where = f"eval.datasets[{i}]"
    if isinstance(entry, str):
        if entry not in SHARED and entry != ENV_SET:
            raise UserError(f"{where}={entry!r} is not a known eval set; name one of {', '.join(SHARED)}, {ENV_SET} "
                            "(the training env's own prompts) or give {name: ..., path: ..., prompt_key: ..., "
                            "answer_key: ..., env: ...}")
        entry = {"name": entry}
    if isinstance(entry, dict) and entry.get("name") == ENV_SET:
        entry = {"env": env_path, "generate": GENERATED, **entry}
    if not isinstance(entry, dict):
        raise UserError(f"{where}: give a set name or a mapping, got {entry!r}")
    fields = [f.name for f in dataclasses.fields(EvalSetSpec)]
    unknown = sorted(set(entry) - set(fields))
    if unknown:
        raise UserError(f"{where}: unknown field(s) {', '.join(unknown)}; the fields are {', '.join(fields)}")
    name = entry.get("name")
    if not name or not isinstance(name, str):
        raise UserError(f"{where}: every entry needs a name")
    base = SHARED.get(name)
    if base is None and not entry.get("path") and not entry.get("generate"):
        raise UserError(f"{where} ({name}): not a shared eval set, so give its path (or generate: N rows from its "
                        "env's make_prompts)")
    if not isinstance(entry.get("generate", 0), int) or entry.get("generate", 0) < 0:
        raise UserError(f"{where} ({name}): generate={entry['generate']!r} must be a whole number of rows")
    spec = dataclasses.replace(base or EvalSetSpec(name), **{k: ("" if v is None else v) for k, v in entry.items()})
    path = Path(spec.path).expanduser()
    if base is not None and "path" not in entry:
        path = data_dir / base.path
    spec.path = str(path)
    if spec.answer_extract not in ANSWER_EXTRACTORS:
        raise UserError(f"{where} ({name}): answer_extract={spec.answer_extract!r}; choose one of {', '.join(ANSWER_EXTRACTORS)}")
    return spec


def load_eval_sets(cfg: EvalConfig, env_path: str = "envs/arithmetic.py") -> list[EvalSet]:
    """Every entry of `cfg.datasets`, read and checked; raises UserError before anything is written. `env_path`:
    the env of the `env` set (the run's env.path)."""
    if not cfg.datasets:
        raise UserError("eval.datasets is empty; e.g. 'eval.datasets=[env]' (the training env's own prompts) or "
                        "'eval.datasets=[gsm8k,mawps]' (shared sets: " + ", ".join(SHARED) + ")")
    data_dir = Path(cfg.data_dir).expanduser() if cfg.data_dir else DEFAULT_DATA_DIR
    sets, names = [], set()
    for i, entry in enumerate(cfg.datasets):
        spec = resolve_spec(entry, i, data_dir, env_path)
        if spec.name in names:
            raise UserError(f"eval.datasets[{i}]: the name {spec.name!r} is used twice")
        names.add(spec.name)
        where = f"eval.datasets[{i}] ({spec.name})"
        if spec.generate:
            sets.append(generated_set(spec, cfg, where))
            continue
        if not Path(spec.path).exists():
            raise UserError(f"{where}: no such file {spec.path}")
        try:
            rows = load_prompts(spec.path, spec.prompt_key, spec.answer_key, "messages", spec.answer_extract, key=where)
        except ValueError as e:
            raise UserError(str(e)) from None
        if not rows:
            raise UserError(f"{where}: {spec.path} has no rows")
        if all(r.answer is None for r in rows):
            fields = sorted(rows[0].extra)
            raise UserError(f"{where}: no row of {spec.path} has the answer key {spec.answer_key!r} (other fields: {', '.join(fields)})")
        if cfg.limit:
            rows = rows[: cfg.limit]
        sets.append(EvalSet(spec, rows, load_env(spec.env, key=f"{where} env")))
    return sets


def generated_set(spec: EvalSetSpec, cfg: EvalConfig, where: str) -> EvalSet:
    """An env's own prompts: `make_prompts(eval.limit or spec.generate, held-out seed)`."""
    env = load_env(spec.env, key=f"{where} env")
    if env.make_prompts is None:
        raise UserError(f"{where}: {spec.env} has no make_prompts(num, seed) to ask; give its held-out rows as a file, "
                        "{name: ..., path: ..., env: " + spec.env + "}")
    num = cfg.limit or spec.generate
    try:
        rows = rows_from_records(env.make_prompts(num, held_out_seed(cfg.seed)), f"{where} {spec.env} make_prompts()",
                                 spec.prompt_key, spec.answer_key, "messages", spec.answer_extract)
    except ValueError as e:
        raise UserError(str(e)) from None
    if not rows:
        raise UserError(f"{where}: {spec.env} make_prompts({num}, ...) made no rows")
    spec = dataclasses.replace(spec, path=f"{spec.env} make_prompts({num}, seed {held_out_seed(cfg.seed)})")
    return EvalSet(spec, rows, env)


def held_out_seed(eval_seed: int) -> int:
    """The seed a generated set asks `make_prompts` with: derived from eval.seed, far from the small seeds of runs."""
    return derive(eval_seed, (HELD_OUT, 1), modulus=2**31)

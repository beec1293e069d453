"""Start-up of a run's OpenReward environments: the served classes, the task rows, the prompt length.

`resolve_envs` turns `env.openreward.*` into `OpenRewardEnvs` (before any process starts: a misspelled key,
a served file without the named class, a hosted env without an API key are one-line `UserError`s).
`task_rows` lists every env's tasks (`splits`, the first `num_samples`) as prompt rows: a row carries the
task's (env, split, index) and a short label as its prompt, since the real prompt comes from the session.
`probe_prompt_tokens` opens one session per env to measure its rendered prompt (it sizes the KV pool).

Left out on purpose: random task subsets (the first `num_samples` are taken; `data.shuffle` orders them)
and refreshing the task list during a run.
"""
from __future__ import annotations

import asyncio
import difflib

from sparserl.data.dataset import PromptRow
from sparserl.rollout.openreward.driver import ROW_KEY, OpenRewardEnvs
from sparserl.rollout.openreward.spec import KEY, parse_envs
from sparserl.utils.errors import UserError


def resolve_envs(openreward_cfg, served_classes: list[str] | None = None) -> OpenRewardEnvs:
    """Typed envs from the `env.openreward` config. `served_classes`: class names of `env.openreward.serve`'s
    file, whose envs are then reached by their class name."""
    specs = parse_envs(openreward_cfg.envs)
    if not specs:
        raise UserError(f"{KEY} is empty: name at least one environment (Org/Name: {{...}})")
    variants: dict[str, str | None] = {}
    if served_classes is not None:
        by_lower = {c.lower(): c for c in served_classes}
        for s in specs:
            if s.base_url:  # an env of its own server: not one of the served file's
                continue
            wanted = (s.variant or s.name.split("/", 1)[1]).lower()
            if wanted not in by_lower:
                close = difflib.get_close_matches(wanted, list(by_lower), n=3, cutoff=0.5)
                hint = f"; did you mean {', '.join(by_lower[c] for c in close)}?" if close else ""
                raise UserError(f"{KEY}.{s.name}: env.openreward.serve={openreward_cfg.serve} serves no environment "
                                f"{wanted!r}{hint} (it serves: {', '.join(served_classes)})")
            variants[s.name] = wanted
    if (served_classes is None and not openreward_cfg.base_url and not all(s.base_url for s in specs)
            and not _has_key(openreward_cfg.api_key_env)):
        raise UserError(f"env.openreward: the hosted environments need an API key in the environment variable "
                        f"{openreward_cfg.api_key_env} (env.openreward.api_key_env), or give env.openreward.base_url "
                        "or env.openreward.serve")
    return OpenRewardEnvs(specs, openreward_cfg.base_url, openreward_cfg.api_key_env, openreward_cfg.tool_parser, variants)


def _has_key(var: str) -> bool:
    import os

    return bool(os.environ.get(var))


async def _task_rows(envs: OpenRewardEnvs) -> list[PromptRow]:
    client = envs.client()
    rows: list[PromptRow] = []
    try:
        for spec in envs.specs:
            handle = envs.handle(client, spec)
            where = f"{spec.name} at {envs.url(spec) or 'the hosted service'}"
            try:
                splits = await handle.list_splits()
                picked: list[tuple[str, int]] = []
                for split in spec.splits:
                    if split not in splits:
                        raise UserError(f"{KEY}.{spec.name}.splits: {split!r} is not a split of {spec.name} (its splits: "
                                        f"{', '.join(splits)})")
                    picked += [(split, i) for i in range(await handle.num_tasks(split))]
                    if spec.num_samples and len(picked) >= spec.num_samples:
                        break
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - any failure here means the env cannot be used
                raise UserError(f"{KEY}.{spec.name}: cannot list the tasks of {where}: {type(e).__name__}: {e}") from None
            picked = picked[: spec.num_samples] if spec.num_samples else picked
            if not picked:
                raise UserError(f"{KEY}.{spec.name}: splits {', '.join(spec.splits)} hold no tasks")
            rows += [PromptRow(prompt=f"{spec.name} {split}[{i}]", answer=None,
                               extra={ROW_KEY: {"env": spec.name, "split": split, "index": i}}, index=len(rows) + j)
                     for j, (split, i) in enumerate(picked)]
    finally:
        await client.environments.aclose()
    return rows


def resolve_variants(envs: OpenRewardEnvs) -> None:
    """Pick, for each env reached at a URL of its own (not the hosted service) and without a `variant`, the
    class its `Name` names on that server (`/list_environments`); a server of one env needs none. Without
    this, a server of several envs would answer every name with its first env."""
    import json
    import urllib.request

    listed: dict[str, list[str]] = {}
    for spec in envs.specs:
        url = envs.url(spec)
        if url is None or envs.variant(spec) is not None:
            continue
        if url not in listed:
            try:
                with urllib.request.urlopen(f"{url.rstrip('/')}/list_environments", timeout=30) as resp:
                    listed[url] = list(json.loads(resp.read()))
            except (OSError, ValueError) as e:
                raise UserError(f"{KEY}.{spec.name}: cannot reach the env server at {url}: {e}") from None
        names = listed[url]
        wanted = spec.name.split("/", 1)[1].lower()
        if wanted in names:
            envs.variants[spec.name] = wanted
        elif len(names) > 1:
            raise UserError(f"{KEY}.{spec.name}: the server at {url} serves {', '.join(names)}; name one of them "
                            f"(Org/<name>) or set variant")


def task_rows(envs: OpenRewardEnvs) -> list[PromptRow]:
    """Every env's tasks as prompt rows, env after env in the config's order (variants resolved first)."""
    resolve_variants(envs)
    return asyncio.run(_task_rows(envs))


def env_sizes(envs: OpenRewardEnvs, rows: list[PromptRow]) -> list[int]:
    """How many rows each env has, in the order of `envs.specs` (rows are grouped by env)."""
    return [sum(r.extra[ROW_KEY]["env"] == s.name for r in rows) for s in envs.specs]


async def _probe(envs: OpenRewardEnvs, tokenizer, rows: list[PromptRow], timeout_s: float) -> int:
    from sparserl.rollout.episode import EnvCalls

    first = [next(r for r in rows if r.extra[ROW_KEY]["env"] == s.name) for s in envs.specs]
    driver = envs.driver(tokenizer, EnvCalls(timeout_s, None))
    try:
        openings = await driver.open(first, [r.prompt for r in first], 1)
    finally:
        await driver.close(None)
    for spec, o in zip(envs.specs, openings):
        if o.status is not None:
            raise UserError(f"{KEY}.{spec.name}: the first task cannot be started: {o.error}")
    return max(len(o.prompt_ids) for o in openings)


def probe_prompt_tokens(envs: OpenRewardEnvs, tokenizer, rows: list[PromptRow], timeout_s: float = 120.0) -> int:
    """The longest rendered prompt (tokens) over one task per env."""
    return asyncio.run(_probe(envs, tokenizer, rows, timeout_s))

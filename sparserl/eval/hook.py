"""Evaluation inside training (`trainer.eval_every > 0`): `eval.*` on the colocated rollout engine.

Runs at step 0 (before any update), every `eval_every` steps and after the last step, with the weights the
engine got from the weight sync that ends each step, so no second model copy exists. The trainer logs the
returned `eval/<set>/<metric>` rows with the step's metrics (step 0 gets a row of its own), and each
evaluation writes `eval.json` and `samples.jsonl` to `trainer.output_dir/eval/step_N/`. The engine runs with
the training rollout's KV settings: a sparse run is evaluated under its compression.
Left out on purpose: a dense evaluation of a sparse run during training (evaluate its `hf/` or a checkpoint
with `python -m sparserl.eval`), and evaluating on a separate process or device.
"""
from __future__ import annotations

from pathlib import Path

from sparserl.config import Config
from sparserl.engines.handle import EngineHandle
from sparserl.eval.datasets import EvalSet
from sparserl.eval.report import format_table, settings, write_outputs
from sparserl.eval.run import evaluate, flat_metrics, format_prompts
from sparserl.utils.errors import UserError
from sparserl.utils.logging import log0


class TrainEval:
    def __init__(self, cfg: Config, sets: list[EvalSet], engine: EngineHandle, tokenizer, mesh, rank: int) -> None:
        """`engine`: the trainer's handle (with tp or cp > 1 its replica group's owner evaluates, the peers receive)."""
        self.cfg, self.sets, self.engine, self.tokenizer, self.rank = cfg, sets, engine, tokenizer, rank
        self.every = cfg.trainer.eval_every
        self.enabled = self.every > 0 and bool(sets)
        self.dp = mesh["dp"]
        self.texts = format_prompts(cfg, sets, tokenizer) if self.enabled else []
        slots = engine.num_slots
        if self.texts and slots:
            longest = max(len(ids) for t in self.texts for ids in tokenizer(t, add_special_tokens=False)["input_ids"])
            if longest + cfg.eval.max_new_tokens > slots:
                raise UserError(f"eval: a prompt of {longest} tokens plus eval.max_new_tokens={cfg.eval.max_new_tokens} "
                                f"does not fit the rollout engine's KV pool of {slots} slots; raise rollout.kv_memory "
                                "(or rollout.kv_pool_tokens) or lower eval.max_new_tokens")

    def run(self, step: int) -> dict[str, float]:
        result = evaluate(self.engine, self.tokenizer, self.cfg, self.sets, self.texts, self.dp.get_local_rank(),
                          self.dp.size(), self.dp.get_group(), self.rank)
        if self.rank == 0:
            out = write_outputs(Path(self.cfg.trainer.output_dir) / "eval" / f"step_{step:06d}", result,
                                {"step": step, **settings(self.cfg, self.cfg.model.path, self.dp.size())})
            log0(format_table(result, f"eval at step {step} ({out})"))
        return flat_metrics(result)

    def maybe(self, step: int, last: bool) -> dict[str, float]:
        """The eval rows when this step is due (every `eval_every` steps, and the last), else nothing."""
        if self.enabled and (step % self.every == 0 or last):
            return self.run(step)
        return {}

"""`torchrun -m sparserl.trainer.grpo key=value ...`: GRPO-family training on (sparse) rollouts.

Each step, top to bottom (reasons in docs/decisions.md):
  1. wake the engine and roll out this rank's prompts through the env (sparserl/rollout);
  2. put the engine to sleep, giving its KV memory back;
  3. logp_old, the dense log-probs of the sampled tokens; with `algo.correction.rescue=dense` the sequences the
     correction would reject are rolled out again densely and replaced (trainer/rescue.py); the reference's; with a
     critic (`critic.enable`, trainer/critic.py) its values;
  4. correct for the sparse/dense sampler mismatch;
  5. advantages (trainer/advantages.py): a group's, per token, or GAE over the critic's values;
  6. the update, after balancing token loads over DP ranks (trainer/balance.py), then the critic's on the same batch;
  7. push the new weights to the engine;
  8. log (metrics, logged samples) and checkpoint.
Steps 3, 4 and 6's loss come from one `LossPath` (trainer/loss_path.py): a separate forward pass before the update,
or, with one update per rollout, the fused path: the update's own forward, with the correction inside it.
With `algo.dynamic_sampling.enable`, step 1 runs in rounds until the step has enough groups with a learning signal
(trainer/dynamic_sampling.py); without it, it is one round.
The loop is `Trainer` (trainer/trainer.py): `Trainer(cfg, inputs)` builds the run, `train_step(step)` is the steps
above, `fit()` runs them, checkpoints and ends the run. This file is the entry point; the work happens in the
functions the trainer calls.

The command line (`--help`, `--cfg job`, overrides) and every input are checked before the training stack
is imported: torch alone takes seconds to import, and a bad key, value, file or folder answers in about one
(sparserl/cli.py, sparserl/config/checks.py, sparserl/trainer/preflight.py).
"""
from __future__ import annotations


from sparserl.cli import run_entry
from sparserl.config import Config


def train(cfg: Config) -> None:
    from sparserl.trainer.preflight import validate_inputs

    inputs = validate_inputs(cfg)  # user errors surface here, before anything is written or torch is imported
    from sparserl.trainer.trainer import Trainer  # the training stack, once the inputs are known to be good

    Trainer(cfg, inputs).fit()


def main(argv: list[str] | None = None) -> None:
    run_entry(train, argv)


if __name__ == "__main__":
    main()

"""The GRPO trainer as an object: `Trainer(cfg, inputs)` builds the run, `train_step(step)` is one step (the steps of
trainer/grpo.py's docstring, in order), `fit()` runs the steps and ends the run.

What `__init__` builds, in this order (the order the random streams and collectives of a run have always had):
processes and the replica group, the tokenizer and the task, the prompt sampler, the actor (and the KL reference),
the rollout engine behind its handle (engines/handle.py: wake, sleep, weight sync and the replica group's owner),
the rollout call (`rollout.worker.Rollouts`), the KV budget controller, the registry of saved state
(trainer/saved_state.py) and the resume from it, the logger and the sample log, the evaluation, the loss path
(trainer/loss_path.py), dynamic sampling and the rescue.
Step 8 is small methods: `_metrics`, `_steer_budget`, `_checkpoint` (the skipped-step guard, preemption, saving).
"""
from __future__ import annotations

import time
from functools import partial

from sparserl.actor import checkpoint
from sparserl.actor.export import export_final
from sparserl.actor.actor import TrainBatch
from sparserl.algo.correction import dist_reduce_sum
from sparserl.algo.sampler_stats import SamplerStats
from sparserl.config import Config
from sparserl.data.prompt_sampler import StepBatch
from sparserl.engine_options.build import build_rollout_engine, pool_slots, sampling_params
from sparserl.engine_options.sizing import SequenceSize, pool_is_sized
from sparserl.engines.handle import EngineHandle
from sparserl.eval.hook import TrainEval
from sparserl.kv.budget_control import BudgetController, tail_key, tail_of
from sparserl.rollout.episode import Sample
from sparserl.rollout.worker import Rollouts
from sparserl.trainer import resume, run_dir
from sparserl.trainer.advantages import set_advantages
from sparserl.trainer.balance import balance_ranks
from sparserl.trainer.critic import CriticStep
from sparserl.trainer.build import (build_actor, build_reference, load_tokenizer, open_output, prompt_sampler,
                                    start_processes, task_env)
from sparserl.trainer.dynamic_sampling import DynamicSampling, Round, StepRollout, round_seed
from sparserl.trainer.faults import PREEMPTED_EXIT_CODE, Preemption, check_skips, injected_nan
from sparserl.trainer.loss import loss_config, zero_advantage_no_grad
from sparserl.trainer.learned_reward import build_learned_reward
from sparserl.trainer.loss_path import LossPath
from sparserl.trainer.metrics import gather_step_metrics, memory_metrics
from sparserl.trainer.partial import (build_partial, fresh_mask, partial_metrics, refuse_dropping,
                                      register as register_partial)
from sparserl.trainer.preflight import Inputs
from sparserl.trainer.rescue import Redraw, Rescue, rescue_seed
from sparserl.trainer.samples import SampleLog
from sparserl.trainer.summary import closing_lines
from sparserl.trainer.saved_state import SavedState, keep
from sparserl.trainer.train_batch import to_train_batch
from sparserl.utils.errors import RunStopped
from sparserl.utils.logging import log0
from sparserl.utils.memory import PhasePeaks, release_free_memory, reuse_heap
from sparserl.utils.seed import seed_step, set_seed
from sparserl.utils.timers import Timers


class Trainer:
    """One GRPO run on this process; see the module docstring."""

    def __init__(self, cfg: Config, inputs: Inputs) -> None:
        """`inputs`: the checked inputs of `preflight.validate_inputs`."""
        self.t_start = time.perf_counter()
        self.cfg = cfg
        self.info, self.dims, self.mesh = start_processes(cfg)
        replica = self.dims.replica_group(self.info.rank)  # with tp or cp > 1 its first rank rolls out for the rest
        self.preemption = Preemption(cfg.trainer.preempt_signals, self.info.device)  # a signal ends the run after a step
        set_seed(cfg.trainer.seed, self.info.rank)
        self.tokenizer = load_tokenizer(inputs.model_path)
        # The prompts: data rows through env.path, or OpenReward tasks (rank 0 serves env.openreward.serve).
        self.task = task_env(cfg, inputs, self.tokenizer, self.info.rank)
        self.sampler = prompt_sampler(cfg, self.task, self.mesh)
        self.params = sampling_params(cfg)
        self.actor = build_actor(cfg, inputs.model_path, self.mesh, self.info.device)
        self.ref = build_reference(cfg, self.actor, inputs.model_path, self.mesh, self.info.device) if cfg.algo.kl.coef else None
        self.critic = CriticStep(cfg, inputs.model_path, self.mesh, self.info.device)  # critic.enable (trainer/critic.py)
        # env.reward_model.path: a frozen reward model scoring every sample (trainer/learned_reward.py)
        self.learned = build_learned_reward(cfg, self.tokenizer, self.mesh, self.info.device)
        self._build_engine(inputs.model_path, replica)
        self.step = self.start = 0  # the last step done, and the step the run goes on from (a resumed one's)
        self.saved = self._saved_state()
        self.resumed_run: str | None = None  # the resumed checkpoint's run id (trainer/run_dir.py)
        self._resume()
        self.run_id = run_dir.run_id(cfg, self.resumed_run)
        self.logger = open_output(cfg, self.info.rank, self.tokenizer, self.run_id)
        self.logger.truncate_after(self.start if self.start else -1)  # a fresh run also drops an old run's step-0 eval row
        self.sample_log = SampleLog(cfg.trainer.output_dir, cfg.trainer.log_samples, self.info.rank, cfg.algo.correction,
                                    self.tokenizer, self.logger.wandb_run)
        self.sample_log.truncate_after(self.start if self.start else -1)
        self.engine.sync()
        self.evals = TrainEval(cfg, inputs.eval_sets, self.engine, self.tokenizer, self.mesh, self.info.rank)
        if self.evals.enabled and self.start == 0:
            self.logger.log(0, self.evals.run(0))
        self._build_step_parts()

    def _build_engine(self, model_path: str, replica) -> None:
        """The rollout engine behind its handle, the rollout call over it, and the KV budget controller."""
        cfg, info = self.cfg, self.info
        self.num_slots = pool_slots(cfg, self.task.max_prompt, cfg.trainer.prompts_per_step // self.dims.dp, model_path,
                                    info.device)
        engine = build_rollout_engine(cfg, model_path, self.tokenizer, info.device, self.num_slots, cfg.trainer.seed,
                                      SequenceSize(self.task.max_prompt, cfg.rollout.max_new_tokens))
        self.engine = EngineHandle(engine, replica, self.actor.full_state, cfg.rollout.release_weights)
        self.rollouts = Rollouts.from_config(cfg, engine, self.tokenizer, self.task.env, self.params, info.rank,
                                             max_turns=cfg.env.max_turns,
                                             max_total_tokens=self.task.max_total_tokens(self.num_slots))
        # rollout.partial.enable: the rollout call that carries unfinished samples across steps (trainer/partial.py)
        self.carry = build_partial(cfg, engine, self.tokenizer, self.task.env, self.params, info.rank,
                                   self.task.max_total_tokens(self.num_slots), self.engine.is_owner)
        control = cfg.rollout.kv.control
        self.budget = BudgetController(control) if cfg.rollout.kv.auto_budget else None  # rollout.kv.budget=auto
        if self.budget is not None:
            log0(f"kv budget: steered by {tail_key(control.statistic)} (every sampled token scored densely, before "
                 f"any filter) toward {control.target}, logged as kv/budget_tail")

    def _saved_state(self) -> SavedState:
        """Every piece of `trainer_state.pt`, once (the keys and their order as checkpoints have always had them)."""
        saved = SavedState()
        saved.register("step", lambda: self.step, self._resumed_at)
        saved.add("scheduler", self.actor.scheduler)
        saved.add("sampler", self.sampler)
        if self.budget is not None:
            saved.register("kv_budget", self.budget.state_dict, self._load_budget, optional=True)
        saved.register("world_size", lambda: self.info.world_size, self._set_saved_world, default=self.info.world_size)
        saved.register("tp", lambda: self.dims.tp, keep, optional=True)
        saved.register("cp", lambda: self.dims.cp, keep, optional=True)
        resume.register(saved, self.cfg, self.actor)  # what a resume checks and keeps (trainer/resume.py)
        saved.register(run_dir.RUN_ID, lambda: self.run_id, self._set_resumed_run, optional=True)
        register_partial(saved, self.carry, self.mesh["dp"].get_local_rank(), self.dims.dp, self.engine.is_owner)
        self.critic.register(saved)
        return saved

    def _set_resumed_run(self, run_id: str) -> None:
        self.resumed_run = str(run_id)

    def _resumed_at(self, step: int) -> None:
        self.step = self.start = int(step)

    def _set_saved_world(self, world_size: int) -> None:
        self.saved_world = int(world_size)

    def _load_budget(self, state: dict) -> None:
        self.budget.load_state_dict(state)
        self.engine.set_kv_budget(self.budget.budget)

    def _resume(self) -> None:
        """`trainer.resume`: the checkpoint's model, optimizer and every registered piece of trainer state. Any number
        of processes: nothing saved depends on it (actor/checkpoint.py)."""
        path = checkpoint.resolve_resume(self.cfg.trainer.resume, self.cfg.trainer.output_dir)
        if path is None:
            return
        state = checkpoint.load(path, self.actor.model, self.actor.optimizer, self.critic.checkpointed())
        refuse_dropping(state, path, self.carry)  # samples in flight, a trained critic: never dropped silently
        self.critic.refuse_dropping(state, path)
        self.saved.load_state_dict(state, path)
        now = self.info.world_size
        log0(f"resumed from {path} at step {self.start}" +
             (f" (saved with {self.saved_world} processes, now {now})" if self.saved_world != now else ""))

    def _build_step_parts(self) -> None:
        """What the steps use: the loss path, the zero-advantage choice, timers, dynamic sampling and the rescue."""
        cfg, actor, info = self.cfg, self.actor, self.info
        self.loss_cfg = loss_config(cfg.algo)
        # The sampler's mismatch before any filter (sampler/*): every dense pass over sparse samples feeds it.
        self.sampled = SamplerStats(cfg.algo.correction)
        self.loss_path = LossPath.choose(cfg, actor, self.loss_cfg, self.sampled)  # a separate pass, or fused
        log0(f"old log-probs: {self.loss_path.description}")
        skip, why_not = zero_advantage_no_grad(cfg)
        # balance_ranks' cost of a trained token vs a no-grad one: forward + backward (2) [+ recomputed forward] vs forward
        self.token_weights = (4 if cfg.model.activation_checkpointing else 3, 1) if skip else (1, 1)
        log0("zero-advantage sequences: " + ("forward without autograd, no backward" if skip else f"trained as the rest ({why_not})"))
        self.timers = Timers(memory=PhasePeaks(info.device))
        self.dynamic = DynamicSampling(cfg.algo, self.params.n, cfg.rollout.max_new_tokens, cfg.trainer.prompts_per_step,
                                       self.sampler, actor.dp_group, self.mesh["dp"].get_local_rank(), self.dims.dp,
                                       info.device, score_every_group=cfg.rollout.kv.budget == "auto")
        self.rescue = Rescue(cfg.algo, self.params.n, actor.dp_group, info.device)  # algo.correction.rescue
        self.draws: dict[int, StepBatch] = {}  # the step's rounds' prompts by round: the rescue finds a group's prompt there

    # ------------------------------------------------------------------------------------------------ the step
    def train_step(self, step: int) -> dict[str, float]:
        """One training step; returns its metrics (logged by `fit`)."""
        cfg, actor, timers = self.cfg, self.actor, self.timers
        t_step = time.perf_counter()
        seed_step(cfg.trainer.seed, step, self.info.rank)
        first = self.sampler.next()
        self.draws.clear()

        # 1: rollout with fresh weights: one round, or with dynamic sampling rounds until the step has
        # trainer.prompts_per_step groups with a learning signal (this rank's share of them in `samples`).
        self.engine.wake(fresh_stats=True)
        step_rollout = self.dynamic.collect(first, partial(self.roll_out, step),
                                            self.dense_logprobs if self.dynamic.scores_rounds else None)
        samples = step_rollout.samples

        # 2: the engine sleeps, giving the KV memory back for training.
        self.engine.sleep()

        # 3: logp_old, the dense log-probs of the sampled tokens under the same weights (a separate pass, or nothing
        # yet: then the update's own forward supplies them), and the reference's.
        batch = to_train_batch(samples, self.info.device, cfg.algo.overlong.mask, step_rollout.logp_old)
        if self.carry is not None:  # sampler/* (the KV budget's tail) reads only the tokens drawn in this step
            batch.fresh_mask = fresh_mask(step, samples, batch)
        with reuse_heap():  # the actor's compute: tensors up to 32 MiB reuse heap pages (utils/memory.py)
            self.loss_path.compute(batch, timers("old_logprobs"))  # the phase's timer, entered by a separate pass only
        # algo.correction.rescue=dense: the sequences the correction rejects, rolled out again densely in their places.
        rescued = self.rescue.run(samples, batch, step_rollout.keys, partial(self.redraw, step), actor.logprobs,
                                  timers("rescue"))
        samples, batch = rescued.samples, rescued.batch
        if self.ref is not None:
            with timers("ref_logprobs"), reuse_heap():
                batch.logp_ref = self.ref.logprobs(batch)
        self.critic.score(batch, timers("critic_values"))  # the critic's values, which GAE reads (critic.enable)

        # 4: sparse/dense mismatch correction (or, on the fused path, inside the update).
        rejected = self.loss_path.correct(batch)

        # 5: advantages (and the critic's targets).
        adv_metrics = set_advantages(cfg.algo, batch, samples, self.params.n, rejected, self.loss_cfg, actor.dp_group,
                                     cfg.rollout.max_new_tokens)
        if injected_nan(step, self.info.rank):  # SPARSERL_FAULT drill (trainer/faults.py)
            batch.advantages.fill_(float("nan"))

        # 6: the update, sequences first spread so every DP rank trains on the same number of tokens.
        with timers("update"), reuse_heap():
            minibatches, balance_metrics = None, {}
            if cfg.actor.balance_ranks:
                batch, minibatches, balance_metrics = balance_ranks(batch, cfg.actor.updates_per_rollout, actor.dp_group,
                                                                    cfg.actor.share_prompts, self.token_weights)
            actor_metrics = actor.update(batch, self.loss_path.loss_fn(), cfg.actor.updates_per_rollout,
                                         cfg.actor.ppo_epochs, minibatches=minibatches)
        actor_metrics |= self.critic.train(batch, minibatches, timers("critic_update"))  # after the actor, same batch
        correction_metrics = self.loss_path.correction_metrics()
        release_free_memory()

        # 7: fresh weights into the engine.
        with timers("weight_sync"):
            self.engine.sync()

        # 8: logged samples (a few sequences token by token, with the logp_old the update used), metrics, the next
        # step's KV budget, and the evaluation when due.
        if self.sample_log.enabled:
            with timers("log_samples"):
                self.sample_log.log(step, samples, batch, correction_metrics.get("correction/norm_factor", 1.0),
                                    actor.dp_group)
        metrics = self._metrics(step, step_rollout, batch, time.perf_counter() - t_step)
        metrics.update(step_rollout.metrics | rescued.metrics | correction_metrics | adv_metrics | balance_metrics
                       | actor_metrics)
        metrics.update(self.sampled.metrics(dist_reduce_sum(actor.dp_group), self.info.device))
        metrics.update(memory_metrics(self.info.device, actor.dp_group))
        if self.learned is not None:
            metrics.update(self.learned.metrics())
        if self.carry is not None:  # carried share, tokens and mismatch by age (after the update: logp_old is set)
            metrics.update(partial_metrics(step, samples, batch, self.carry, actor.dp_group, self.info.device))
        # The next step's KV budget before the evaluation: it evaluates the updated weights at the budget a checkpoint
        # of this step saves, which is what `python -m sparserl.eval` of the checkpoint takes (eval/run_settings.py).
        self._steer_budget(metrics)
        metrics.update(self.evals.maybe(step, self._is_last(step)))
        return metrics

    def roll_out(self, step: int, draw: StepBatch, round_: int) -> Round:
        """One rollout round of `step`: the replica group's owner runs the engine and the env loop, its peers receive
        its samples, rollout metrics and engine stats, so the group trains on one batch whatever the env does per
        process."""
        # the last round's dense pass or the reward model's scoring put the engine to sleep
        if round_ > 1 and (self.dynamic.scores_rounds or self.learned is not None):
            self.engine.wake_again(self.timers("weight_sync"))
        self.draws[round_] = draw

        def run(engine) -> tuple:
            # Each prompt's samples are keyed by (seed, step, round, its place in the round's global batch): the same
            # whatever the number of processes (elastic resume).
            engine.set_seed(seed := round_seed(self.cfg.trainer.seed, step, round_))
            rollouts = self.rollouts if self.carry is None else self.carry.at(step, seed)  # rollout.partial
            label = f"rollout {step}" if round_ == 1 else f"rollout {step}.{round_}"
            samples, metrics = rollouts(*self._prompts(draw.local_indices),
                                        [draw.local_start + j for j in range(len(draw.local_indices))], label)
            return samples, metrics, engine.stats()

        with self.timers("rollout"):
            done = Round(*self.engine.on_owner(run))
        self._learned_reward(done.samples)
        return done

    def _learned_reward(self, samples: list[Sample]) -> None:
        """env.reward_model.path: the samples' rewards from the reward model, scored with the engine asleep."""
        if self.learned is None:
            return
        self.engine.sleep()
        with self.timers("reward_model"), reuse_heap():
            self.learned.apply(samples)

    def redraw(self, step: int, redraws: list[Redraw]) -> list[Sample]:
        """The rescue's re-roll: each rejected sample's prompt once more, through the env loop, generated densely
        with the current weights (the engine woken again after step 2); the replica group's peers receive them."""
        self.engine.wake_again()

        def run(engine) -> list[Sample]:
            engine.reset_stats()  # the step's kv/ and perf/rollout numbers stay the sparse rollout's
            engine.set_seed(rescue_seed(self.cfg.trainer.seed, step))
            picked = [self.draws[r.key[0]].global_indices[r.key[1]] for r in redraws]
            if not picked:  # another rank's samples are re-rolled, none of this one's
                return []
            with engine.dense():
                new, _ = self.rollouts(*self._prompts(picked), [r.seed_index for r in redraws], f"rescue {step}", n=1)
            return new

        new = self.engine.on_owner(run)
        self.engine.sleep()
        self._learned_reward(new)
        return new

    def dense_logprobs(self, batch: TrainBatch):
        """Dynamic sampling's judge under the correction: a round's logp_old, the engine asleep meanwhile."""
        self.engine.sleep()
        with self.timers("old_logprobs"), reuse_heap():
            logp_old = self.actor.logprobs(batch)
        if logp_old is not None:  # None: no rank had a sequence to score (a round with no reward signal anywhere)
            self.sampled.add_batch(logp_old, batch)
        return logp_old

    def _prompts(self, indices: list[int]) -> tuple[list, list[str]]:
        return [self.task.rows[i] for i in indices], [self.task.prompts[i] for i in indices]

    # ------------------------------------------------------------------------------------------------ step 8
    def _is_last(self, step: int) -> bool:
        return step == self.cfg.trainer.total_steps or step == self.cfg.trainer.stop_after

    def _metrics(self, step: int, step_rollout: StepRollout, batch: TrainBatch, step_s: float) -> dict[str, float]:
        """The step's rollout, engine, batch and timing metrics over every DP rank."""
        r = step_rollout
        return gather_step_metrics(step, r.rolled, r.rollout_metrics, r.engine_stats, batch,
                                   self.timers.pop(), step_s, self.actor.dp_group, self.info.device,
                                   retractions=pool_is_sized(self.cfg))

    def _steer_budget(self, metrics: dict[str, float]) -> None:
        """rollout.kv.budget=auto: the next step's budget, from this step's sampler tail (before any filter)."""
        if self.budget is None:
            return
        metrics["kv/budget"] = self.budget.budget
        metrics["kv/budget_tail"] = tail = tail_of(metrics, self.cfg.rollout.kv.control.statistic)
        self.engine.set_kv_budget(self.budget.update(tail))

    def _checkpoint(self, step: int) -> None:
        """After a logged step: the skipped-step guard, then a checkpoint when due, or when a signal asked the run
        to stop (which then ends here, with its exit code)."""
        t, last = self.cfg.trainer, self._is_last(step)
        check_skips(self.actor.consecutive_skips, t.max_skipped_steps, step, t.output_dir)
        preempted = self.preemption.requested()  # a collective: every rank learns whether any rank was signalled
        if (t.save_every and step % t.save_every == 0) or last or preempted:
            self.save(step)
        if preempted and not last:
            self.logger.close()
            raise RunStopped(f"preempted ({self.preemption.signalled or 'signal on another rank'}) during step {step}: "
                             f"saved {checkpoint.checkpoint_dir(t.output_dir, step)}; "
                             "continue with trainer.resume=auto", exit_code=PREEMPTED_EXIT_CODE)

    def save(self, step: int) -> None:
        """A checkpoint of `step`: the actor's shards and every registered piece of trainer state."""
        self.step = step
        checkpoint.save(self.cfg.trainer.output_dir, step, self.actor.model, self.actor.optimizer,
                        self.saved.state_dict(), self.info.rank, self.cfg.trainer.keep_last, self.critic.checkpointed())

    # ------------------------------------------------------------------------------------------------ the run
    def fit(self) -> None:
        """The steps from the resumed one to `trainer.total_steps` (or `trainer.stop_after`); then the HF export
        (`trainer.export_hf`, when the run reached its last step) and the end of everything the run started."""
        t = self.cfg.trainer
        stopped = ""
        for step in range(self.start + 1, t.total_steps + 1):
            self.step = step
            self.logger.log(step, self.train_step(step))
            self._checkpoint(step)
            if step == t.stop_after:
                log0(f"stopping after step {step} (trainer.stop_after)")
                stopped = "trainer.stop_after"
                break
        else:
            if t.export_hf:
                export_final(self.cfg, self.actor, self.tokenizer, self.info.rank)
        self.close()
        if self.info.rank == 0:  # steps, reward first -> last, KV kept, time, and what to run next
            for line in closing_lines(t.output_dir, self.step, t.total_steps, time.perf_counter() - self.t_start, stopped):
                log0(line)

    def close(self) -> None:
        self.logger.close()
        self.engine.close()
        self.task.close()

"""`torchrun -m sparserl.trainer.grpo key=value ...`: GRPO-family training on (sparse) rollouts.

Each step, top to bottom (reasons in docs/decisions.md):
  1. wake the engine and roll out this rank's prompts through the env (sparserl/rollout);
  2. put the engine to sleep, giving its KV memory back;
  3. logp_old, the dense log-probs of the sampled tokens; with `algo.correction.rescue=dense` the sequences the
     correction would reject are rolled out again densely and replaced (trainer/rescue.py); the reference's;
  4. correct for the sparse/dense sampler mismatch;
  5. group advantages (trainer/advantages.py);
  6. the update, after balancing token loads over DP ranks (trainer/balance.py);
  7. push the new weights to the engine;
  8. log (metrics, logged samples) and checkpoint.
Steps 3, 4 and 6's loss come from one `OldLogprobs` strategy (trainer/old_logprobs.py): a separate forward pass
before the update, or, with one update per rollout, the update's own forward with the correction inside it.
With `algo.dynamic_sampling.enable`, step 1 runs in rounds until the step has enough groups with a learning signal
(trainer/dynamic_sampling.py); without it, it is one round.
This file orchestrates; the work happens in the functions it calls.

The command line (`--help`, `--cfg job`, overrides) and every input are checked before the training stack
is imported: torch alone takes seconds to import, and a bad key, value, file or folder answers in about one
(sparserl/cli.py, sparserl/config/checks.py, sparserl/trainer/preflight.py).
"""
from __future__ import annotations

import sys
import time
from functools import partial

from sparserl.cli import parse_cli
from sparserl.config import Config
from sparserl.utils.errors import run_main


class _Progress:
    """Engine wrapper that advances a progress bar as sequences finish (multi-turn sessions pass through)."""

    def __init__(self, engine, bar):
        self.engine, self.bar = engine, bar
        self.supports_sessions = getattr(engine, "supports_sessions", False)

    def generate(self, requests, progress=None):
        return self.engine.generate(requests, progress=self.bar.update)

    def end_sessions(self, session_ids=None):
        return self.engine.end_sessions(session_ids)


def train(cfg: Config) -> None:
    from sparserl.trainer.preflight import validate_inputs

    inputs = validate_inputs(cfg)  # user errors surface here, before anything is written or torch is imported
    # The training stack, imported only once the inputs are known to be good (see the module docstring).
    from sparserl.actor import checkpoint
    from sparserl.eval.hook import TrainEval
    from sparserl.engines.weight_sync import sync_weights
    from sparserl.rollout.worker import rollout
    from sparserl.engine_options.build import build_rollout_engine, pool_slots, sampling_params
    from sparserl.algo.correction import dist_reduce_sum
    from sparserl.algo.sampler_stats import SamplerStats
    from sparserl.kv.budget_control import BudgetController, tail_key, tail_of
    from sparserl.trainer import setup as S
    from sparserl.trainer.faults import PREEMPTED_EXIT_CODE, Preemption, check_skips, injected_nan
    from sparserl.trainer.advantages import set_advantages
    from sparserl.trainer.balance import balance_ranks
    from sparserl.trainer.dynamic_sampling import DynamicSampling, Round, round_seed
    from sparserl.trainer.loss import loss_config, zero_advantage_no_grad
    from sparserl.trainer.old_logprobs import OldLogprobs
    from sparserl.trainer.rescue import Redraw, Rescue, rescue_seed
    from sparserl.trainer.train_batch import to_train_batch
    from sparserl.trainer.metrics import gather_step_metrics
    from sparserl.trainer.samples import SampleLog
    from sparserl.utils.logging import log0, progress
    from sparserl.utils.memory import PhasePeaks, release_free_memory, reuse_heap
    from sparserl.utils.errors import RunStopped
    from sparserl.utils.seed import seed_step, set_seed
    from sparserl.utils.timers import Timers

    info, dims, mesh = S.start_processes(cfg)
    tp_share = dims.tp_share(info.rank)  # with tp or cp > 1 the first of a DP rank's ranks rolls out, its peers receive the samples
    preemption = Preemption(cfg.trainer.preempt_signals, info.device)  # from here on a signal ends the run after a step
    set_seed(cfg.trainer.seed, info.rank)
    tokenizer = S.load_tokenizer(inputs.model_path)
    # The prompts: data rows through env.path, or OpenReward tasks (rank 0 serves env.openreward.serve).
    task = S.task_env(cfg, inputs, tokenizer, info.rank)
    rows, prompts = task.rows, task.prompts
    sampler = S.prompt_sampler(cfg, task, mesh)
    params = sampling_params(cfg)
    actor = S.build_actor(cfg, inputs.model_path, mesh, info.device)
    ref = S.build_reference(cfg, actor, inputs.model_path, mesh, info.device) if cfg.algo.kl.coef else None
    num_slots = pool_slots(cfg, task.max_prompt, cfg.trainer.prompts_per_step // dims.dp)
    engine = build_rollout_engine(cfg, inputs.model_path, tokenizer, info.device, num_slots, cfg.trainer.seed)
    budget = BudgetController(cfg.rollout.kv.control) if cfg.rollout.kv.auto_budget else None  # rollout.kv.budget=auto
    if budget is not None:
        log0(f"kv budget: steered by {tail_key(cfg.rollout.kv.control.statistic)} (every sampled token scored "
             f"densely, before any filter) toward {cfg.rollout.kv.control.target}, logged as kv/budget_tail")
    start = 0
    resume_from = checkpoint.resolve_resume(cfg.trainer.resume, cfg.trainer.output_dir)
    if resume_from is not None:  # any number of processes: nothing saved depends on it (actor/checkpoint.py)
        state = checkpoint.load(resume_from, actor.model, actor.optimizer)
        actor.scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        S.restore_skips(state, actor)  # its saved settings were checked / restored in S.start_processes
        if budget is not None and "kv_budget" in state:
            budget.load_state_dict(state["kv_budget"])
            engine.set_kv_budget(budget.budget)
        start = state["step"]
        saved_with = state.get("world_size", info.world_size)
        log0(f"resumed from {resume_from} at step {start}" +
             (f" (saved with {saved_with} processes, now {info.world_size})" if saved_with != info.world_size else ""))
    logger = S.open_output(cfg, info.rank, tokenizer)
    logger.truncate_after(start if start else -1)  # a fresh run also drops an old run's step-0 eval row
    sample_log = SampleLog(cfg.trainer.output_dir, cfg.trainer.log_samples, info.rank, cfg.algo.correction,
                           tokenizer, logger.wandb_run)
    sample_log.truncate_after(start if start else -1)
    sync_weights(actor.full_state(), engine)
    evals = TrainEval(cfg, inputs.eval_sets, engine, tokenizer, mesh, info.rank, tp_share)  # trainer.eval_every
    if evals.enabled and start == 0:
        logger.log(0, evals.run(0))
    loss_cfg = loss_config(cfg.algo)
    # The sampler's mismatch before any filter (sampler/*): every dense pass over sparse samples feeds it.
    sampled = SamplerStats(cfg.algo.correction)
    old_logprobs = OldLogprobs.choose(cfg, actor, loss_cfg, sampled)  # a separate pass, or the update's own forward
    log0(f"old log-probs: {old_logprobs.description}")
    skip, why_not = zero_advantage_no_grad(cfg)
    # balance_ranks' cost of a trained token vs a no-grad one: forward + backward (2) [+ recomputed forward] vs forward
    token_weights = (4 if cfg.model.activation_checkpointing else 3, 1) if skip else (1, 1)
    log0("zero-advantage sequences: " + ("forward without autograd, no backward" if skip else f"trained as the rest ({why_not})"))
    timers = Timers(memory=PhasePeaks(info.device))
    dynamic = DynamicSampling(cfg.algo, params.n, cfg.rollout.max_new_tokens, cfg.trainer.prompts_per_step, sampler,
                              actor.dp_group, mesh["dp"].get_local_rank(), dims.dp, info.device)
    rescue = Rescue(cfg.algo, params.n, actor.dp_group, info.device)  # algo.correction.rescue
    draws = {}  # the step's rollout rounds' prompts by round: the rescue finds a group's prompt there

    def roll_out(step: int, draw, round_: int) -> Round:
        """One rollout round of `step`. With tp > 1 only the TP group's owner runs the engine and the env loop; its
        peers receive its samples, rollout metrics and engine stats (parallel.TPShare), so the group trains on one
        batch whatever the env does per process."""
        if round_ > 1 and dynamic.judges_correction:  # the last round's dense pass put the engine to sleep
            if cfg.rollout.release_weights:
                with timers("weight_sync"):
                    sync_weights(actor.full_state(), engine)
            if tp_share.is_owner:
                engine.wake()
        rolled, draws[round_] = None, draw
        with timers("rollout"):
            if tp_share.is_owner:
                # Each prompt's samples are keyed by (seed, step, round, its place in the round's global batch): the
                # same whatever the number of processes (elastic resume).
                engine.set_seed(round_seed(cfg.trainer.seed, step, round_))
                step_rows, texts = [rows[i] for i in draw.local_indices], [prompts[i] for i in draw.local_indices]
                rolled = ([], {})
                if step_rows:
                    label = f"rollout {step}" if round_ == 1 else f"rollout {step}.{round_}"
                    with progress(len(step_rows) * params.n, label, info.rank, cfg.logger.progress) as bar:
                        rolled = rollout(_Progress(engine, bar), tokenizer, task.env, step_rows, texts, params,
                                         max_turns=cfg.env.max_turns, max_total_tokens=task.max_total_tokens(num_slots),
                                         seed_indices=[draw.local_start + j for j in range(len(step_rows))],
                                         step_timeout_s=cfg.env.step_timeout_s, max_concurrency=cfg.env.max_concurrency)
                rolled += (engine.stats(),)
            return Round(*tp_share.from_owner(rolled))

    def redraw(step: int, redraws: list[Redraw]) -> list:
        """The rescue's re-roll: each rejected sample's prompt once more, through the env loop, generated densely
        with the current weights (the engine woken again after step 2); TP peers receive the owner's samples."""
        if cfg.rollout.release_weights:
            sync_weights(actor.full_state(), engine)
        new = None
        if tp_share.is_owner:
            engine.wake()
            engine.reset_stats()  # the step's kv/ and perf/rollout numbers stay the sparse rollout's
            engine.set_seed(rescue_seed(cfg.trainer.seed, step))
            idx = [draws[r.key[0]].global_indices[r.key[1]] for r in redraws]
            new = []
            if idx:
                with progress(len(idx), f"rescue {step}", info.rank, cfg.logger.progress) as bar, engine.dense():
                    new, _ = rollout(_Progress(engine, bar), tokenizer, task.env, [rows[i] for i in idx],
                                     [prompts[i] for i in idx], params.replace(n=1), max_turns=cfg.env.max_turns,
                                     max_total_tokens=task.max_total_tokens(num_slots),
                                     seed_indices=[r.seed_index for r in redraws],
                                     step_timeout_s=cfg.env.step_timeout_s, max_concurrency=cfg.env.max_concurrency)
        engine.sleep()
        release_free_memory()
        return tp_share.from_owner(new)

    def dense_logprobs(batch):
        """Dynamic sampling's judge under the correction: a round's logp_old, the engine asleep meanwhile."""
        engine.sleep()
        release_free_memory()
        with timers("old_logprobs"), reuse_heap():
            logp_old = actor.logprobs(batch)
        sampled.add_batch(logp_old, batch)
        return logp_old

    def save(step: int) -> None:
        state = {"step": step, "scheduler": actor.scheduler.state_dict(), "sampler": sampler.state_dict(),
                 **({"kv_budget": budget.state_dict()} if budget is not None else {}),
                 "world_size": info.world_size, "tp": dims.tp, "cp": dims.cp,
                 **S.resume_record(cfg, actor.consecutive_skips)}  # what a resume checks and keeps (trainer/resume.py)
        checkpoint.save(cfg.trainer.output_dir, step, actor.model, actor.optimizer, state, info.rank, cfg.trainer.keep_last)

    for step in range(start + 1, cfg.trainer.total_steps + 1):
        t_step = time.perf_counter()
        seed_step(cfg.trainer.seed, step, info.rank)
        batch_idx = sampler.next()
        draws.clear()

        # 1: rollout with fresh weights: one round, or with dynamic sampling rounds until the step has
        # trainer.prompts_per_step groups with a learning signal (this rank's share of them in `samples`).
        if tp_share.is_owner:
            engine.wake()
            engine.reset_stats()
        step_rollout = dynamic.collect(batch_idx, partial(roll_out, step),
                                       dense_logprobs if dynamic.judges_correction else None)
        samples, rollout_metrics = step_rollout.samples, step_rollout.rollout_metrics
        engine_stats = step_rollout.engine_stats

        # 2: the engine sleeps, giving the KV memory back for training.
        engine.sleep()  # a peer's engine never woke; this still drops its weights under rollout.release_weights
        release_free_memory()

        # 3: logp_old, the dense log-probs of the sampled tokens under the same weights (a separate pass, or nothing
        # yet: then the update's own forward supplies them), and the reference's.
        batch = to_train_batch(samples, info.device, cfg.algo.overlong.mask, step_rollout.logp_old)
        with reuse_heap():  # the actor's compute: tensors up to 32 MiB reuse heap pages (utils/memory.py)
            old_logprobs.compute(batch, timers("old_logprobs"))  # the phase's timer, entered by a separate pass only
        # algo.correction.rescue=dense: the sequences the correction rejects, rolled out again densely in their places.
        rescued = rescue.run(samples, batch, step_rollout.keys, partial(redraw, step), actor.logprobs, timers("rescue"))
        samples, batch = rescued.samples, rescued.batch
        if ref is not None:
            with timers("ref_logprobs"), reuse_heap():
                batch.logp_ref = ref.logprobs(batch)

        # 4: sparse/dense mismatch correction (or, on the single-update path, inside the update).
        rejected = old_logprobs.correct(batch)

        # 5: group advantages.
        adv_metrics = set_advantages(cfg.algo, batch, samples, params.n, rejected, loss_cfg, actor.dp_group,
                                     cfg.rollout.max_new_tokens)
        if injected_nan(step, info.rank):  # SPARSERL_FAULT drill (trainer/faults.py)
            batch.advantages.fill_(float("nan"))

        # 6: the update, sequences first spread so every DP rank trains on the same number of tokens.
        with timers("update"), reuse_heap():
            minibatches, balance_metrics = None, {}
            if cfg.actor.balance_ranks:
                batch, minibatches, balance_metrics = balance_ranks(batch, cfg.actor.updates_per_rollout, actor.dp_group,
                                                                    cfg.actor.share_prompts, token_weights)
            actor_metrics = actor.update(batch, old_logprobs.loss_fn(), cfg.actor.updates_per_rollout,
                                         cfg.actor.ppo_epochs, minibatches=minibatches)
        correction_metrics = old_logprobs.correction_metrics()
        release_free_memory()

        # 7: fresh weights into the engine.
        with timers("weight_sync"):
            sync_weights(actor.full_state(), engine)

        # 8: logged samples (a few sequences token by token, with the logp_old the update used), metrics, checkpoints.
        if sample_log.enabled:
            with timers("log_samples"):
                sample_log.log(step, samples, batch, correction_metrics.get("correction/norm_factor", 1.0), actor.dp_group)
        metrics = gather_step_metrics(step, step_rollout.rolled, rollout_metrics, engine_stats, batch, timers.pop(),
                                      time.perf_counter() - t_step, actor.dp_group, info.device)
        metrics.update(step_rollout.metrics | rescued.metrics | correction_metrics | adv_metrics | balance_metrics
                       | actor_metrics)
        metrics.update(sampled.metrics(dist_reduce_sum(actor.dp_group), info.device))
        metrics.update(memory_metrics(info.device, actor.dp_group))
        last = step == cfg.trainer.total_steps or step == cfg.trainer.stop_after
        metrics.update(evals.maybe(step, last))
        if budget is not None:  # the next step's budget, from this step's sampler tail (before any filter)
            metrics["kv/budget"] = budget.budget
            metrics["kv/budget_tail"] = tail = tail_of(metrics, cfg.rollout.kv.control.statistic)
            engine.set_kv_budget(budget.update(tail))
        logger.log(step, metrics)
        check_skips(actor.consecutive_skips, cfg.trainer.max_skipped_steps, step, cfg.trainer.output_dir)
        preempted = preemption.requested()  # a collective: every rank learns whether any rank was signalled
        if (cfg.trainer.save_every and step % cfg.trainer.save_every == 0) or last or preempted:
            save(step)
        if preempted and not last:
            logger.close()
            raise RunStopped(f"preempted ({preemption.signalled or 'signal on another rank'}) during step {step}: "
                             f"saved {checkpoint.checkpoint_dir(cfg.trainer.output_dir, step)}; "
                             "continue with trainer.resume=auto", exit_code=PREEMPTED_EXIT_CODE)
        if step == cfg.trainer.stop_after:
            log0(f"stopping after step {step} (trainer.stop_after)")
            break
    else:
        if cfg.trainer.export_hf:
            from sparserl.actor.export import export_final

            export_final(cfg, actor, tokenizer, info.rank)
    logger.close()
    engine.close()
    task.close()


def peak_memory_gb(device: torch.device) -> float:
    import torch

    from sparserl.utils.memory import peak_rss_gb

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_rss_gb()


def memory_metrics(device: torch.device, group) -> dict[str, float]:
    """This rank's peak and current memory (`mem/peak_gb`, `mem/rss_gb`) and the largest peak of any DP rank."""
    import torch
    import torch.distributed as dist

    from sparserl.utils.memory import rss_bytes

    peak = peak_memory_gb(device)
    top = torch.tensor([peak], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return {"mem/peak_gb": peak, "mem/peak_gb_max_rank": float(top), "mem/rss_gb": rss_bytes() / 2**30}


def main(argv: list[str] | None = None) -> None:
    def run() -> None:
        cfg = parse_cli(sys.argv[1:] if argv is None else argv, "grpo")
        if cfg is not None:  # None: --help or --cfg job was answered
            train(cfg)

    run_main(run)


if __name__ == "__main__":
    main()

"""Every metric a run writes to `metrics.jsonl` (and wandb), with what it means.

This is the one list of metric names: docs/metrics.md is generated from it (scripts/gen_reference.py), and the
tests hold the code to it both ways a name can drift: tests/e2e/test_metric_names.py runs a one-step training
run with most features on and checks that every key of its metrics.jsonl is listed here, and
tests/unit/test_metric_names.py checks every metric-shaped string in sparserl/'s source (literals and f-strings),
every timer phase of the trainer and every tool counter against this list (and that no listed name is stale).

A name is exact (`reward/mean`) or a family with `<placeholder>` parts (`eval/<set>/pass@<k>`); `PLACEHOLDERS`
says what each part may be, and `find(key)` gives the entry that documents a logged key. Names the code builds
but never logs (per-rank sums that the trainer reduces into other metrics) are in `INTERNAL`, with the metric
they become. Pure data and the standard library, so the docs and the checks import no torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # exact, or with <placeholder> parts
    meaning: str  # one line
    when: str = ""  # the settings under which a run logs it; empty: every training step


# The groups, in the order docs/metrics.md lists them: the prefix before the first `/`, and what its metrics share.
GROUPS: dict[str, str] = {
    "step": "The row's step.",
    "reward": "The env's rewards of the step's samples, over all data-parallel ranks.",
    "score": "The env's score (its own measure of success, reported beside the reward), over all ranks.",
    "response": "Lengths and endings of the sampled responses, over all ranks.",
    "env": "How the episodes went, over all ranks.",
    "adv": ("Advantages (`algo.adv_estimator`) of the sequences on rank 0: one per sequence, or for a per-token "
            "estimator (reinforce_pp, reinforce_pp_baseline, gae) one per loss token, over those tokens."),
    "dynamic": ("Dynamic sampling (`algo.dynamic_sampling.enable=true`): the step's rollout rounds and the groups "
                "(a prompt's `rollout.n` samples) with a learning signal, over all data-parallel ranks "
                "(docs/training.md). With it on, the reward/, score/, response/, env/ and kv/ metrics cover every "
                "round's samples, dropped groups included; sampler/ every sample a round scored densely; adv/, actor/, "
                "mismatch/, correction/ and overlong/ the groups trained on."),
    "overlong": ("Responses cut by a length limit (`algo.overlong.*`), over the step's trained samples on all "
                 "data-parallel ranks."),
    "actor": "The policy update: means over the step's optimizer steps and all ranks.",
    "rm": ("The reward model's update (python -m sparserl.trainer.rm, docs/rm.md): means over the step's pairs on "
           "all ranks; eval/rm/ the same on the held-out pairs."),
    "dpo": ("The DPO / IPO update (python -m sparserl.trainer.dpo, docs/dpo.md): means over the step's pairs on all "
            "ranks; rewards are beta (logp - logp_ref) of a response; eval/dpo/ the same on the held-out pairs."),
    "reward_model": ("The learned reward (`env.reward_model.path`, docs/rm.md): the reward model's scores of the step's "
                     "scored samples (not ended by an error, timeout or abort), over all data-parallel ranks; reward/ "
                     "is then the reward the advantages read."),
    "critic": ("The critic's update (`critic.enable=true`, `algo.adv_estimator=gae`): means over the step's optimizer "
               "steps and all ranks; the value statistics over the loss tokens of all ranks, with the values GAE read."),
    "mismatch": ("How far the sampler's log-probs (logp_sparse) are from the trainer's dense recompute (logp_old) on "
                 "the response tokens of the batch trained on, all ranks; logged whether or not the correction is on "
                 "(docs/correction.md). xi = exp(logp_old - logp_sparse). The batch is what dynamic sampling kept "
                 "and the rescue made of the rollout: sampler/ has the same tail before those filters."),
    "sampler": ("The sparse sampler's mismatch as it sampled: every sampled token (length-cut ones included) of every "
                "sequence whose dense log-probs the step computed (each dynamic-sampling round's pass, the logp_old "
                "pass or the update's forward; not the rescue's dense redraws), before dynamic sampling, the "
                "correction or the rescue chose what to train on, all ranks (algo/sampler_stats.py). Without dynamic "
                "sampling that is every sample of the step. Under it, each round scores the groups whose rewards "
                "differ where the correction is applied, and none otherwise (the kept groups are then scored in the "
                "batch), except with `rollout.kv.budget=auto`: then every group of every round, tied ones included, "
                "so the budget controller's tail sees every sampled token. With partial rollouts, only the tokens "
                "drawn in the step: a carried token's xi also holds the updates since it was drawn (partial/)."),
    "correction": ("The sparsity correction (`algo.correction.*`): token mask, sequence rejection and importance "
                   "weights, over the response tokens (or sequences) of the step on all ranks."),
    "rescue": ("The rescue of rejected samples (`algo.correction.rescue=dense`, docs/correction.md): the sequences the "
               "correction rejects, rolled out again with a dense KV cache and trained on in their place, over all "
               "data-parallel ranks. With it on, reward/, score/, response/, env/ and kv/ cover the sparse rollout "
               "(the rejected samples, not their redraws); adv/, actor/, mismatch/ and correction/ the batch trained "
               "on, redraws included."),
    "partial": ("Partial rollouts (`rollout.partial.enable=true`, docs/training.md): samples carried across steps, "
                "over all data-parallel ranks. A token's age is the number of steps between the weights that drew it "
                "and the step that trains on it. With it on, reward/, score/ and response/ cover the groups trained "
                "this step (those whose samples all ended), and kv/ and perf/rollout_tok_s the step's engine calls."),
    "kv": "The rollout engine's KV cache during the step's rollout.",
    "rollout": "The rollout engine's own numbers, mean over data-parallel ranks.",
    "perf": "Wall-clock time and throughput.",
    "mem": "Memory in GiB: allocated device memory on a GPU, resident memory (RSS) on a CPU.",
    "eval": ("Evaluation during training (`trainer.eval_every > 0`): the `eval.*` sets on the rollout engine, at "
             "step 0, every `eval_every` steps and after the last step; the numbers `python -m sparserl.eval` prints."),
    "openreward": "OpenReward environments (`env.openreward.envs`), per environment.",
    "tool": "Tool calls of OpenReward episodes, mean per sample over all ranks.",
}

# The phases the trainer times (`timers(NAME)` in sparserl/trainer/trainer.py): `perf/<phase>_s`,
# `mem/<phase>_peak_gb`, `mem/<phase>_end_gb`.
PHASES: dict[str, str] = {
    "rollout": "sampling the step's responses through the env",
    "old_logprobs": "the separate dense forward for logp_old (when the update cannot give it: several optimizer steps per rollout)",
    "rescue": "re-rolling the rejected sequences densely and their logp_old pass (`algo.correction.rescue=dense`, "
              "steps where the correction rejects some)",
    "ref_logprobs": "the reference model's log-probs (`algo.kl.coef > 0`)",
    "update": "rank balancing and the optimizer steps",
    "reward_model": "the reward model's no-grad scoring of the samples, the engine asleep (`env.reward_model.path`)",
    "critic_values": "the critic's no-grad pass for the values GAE reads (`critic.enable=true`)",
    "critic_update": "the critic's optimizer steps, after the actor's (`critic.enable=true`)",
    "weight_sync": "pushing the new weights into the rollout engine",
    "log_samples": "writing `trainer.log_samples` sequences to samples/step_N.jsonl",
}

# The counters of an OpenReward episode (sparserl/rollout/openreward/driver.py TOOL_STATS): `tool/<counter>_mean`.
TOOL_COUNTERS: dict[str, str] = {
    "calls": "tool calls sent to the environment",
    "malformed": "tool calls the parser could not read (the model gets an error message)",
    "errors": "tool calls answered with an error: an unknown tool, or one the tool refused (bad arguments)",
    "failed": "tool calls that raised in the environment (the sample ends with status error)",
}

SFT = "python -m sparserl.trainer.sft too"
CORRECTION = "`algo.correction.enable=true`"
RESCUE = "`algo.correction.rescue=dense`"
DYNAMIC = "`algo.dynamic_sampling.enable=true`"
PARTIAL = "`rollout.partial.enable=true`"
CRITIC = "`critic.enable=true`"
LEARNED = "`env.reward_model.path` set"

METRICS: tuple[Metric, ...] = (
    Metric("step", "The training step, from 1; the evaluation before training has a row of its own with step 0",
           "every row"),
    # reward/, score/
    Metric("reward/mean", "Mean reward of the step's samples"),
    Metric("reward/std", "Standard deviation of those rewards (over all samples, not within groups)"),
    Metric("reward/kl", "Mean per-token KL estimate (`algo.kl.estimator`) of the sampling policy to the reference",
           "`algo.kl.coef > 0`, `algo.kl.mode=reward`"),
    Metric("reward/kl_penalty", "Mean per-token penalty `algo.kl.coef` x `reward/kl`; each sequence's sum is "
           "subtracted from its reward before the advantages", "`algo.kl.coef > 0`, `algo.kl.mode=reward`"),
    Metric("score/mean", "Mean env score of the samples"),
    # response/
    Metric("response/len_mean", "Mean response length in tokens (every turn after the prompt, env observations included)"),
    Metric("response/len_max", "Longest response in tokens"),
    Metric("response/truncated_frac", "Share of samples that ended at a length limit (`rollout.max_new_tokens` or "
           "the room left in the context) instead of at EOS, a stop string or the env's end"),
    # env/
    Metric("env/error_frac", "Share of samples whose env step or reset raised (reward 0; training goes on)"),
    Metric("env/error_count", "Number of those samples"),
    Metric("env/timeout_frac", "Share of samples whose env call ran past `env.step_timeout_s` (reward 0)"),
    Metric("env/turns_mean", "Mean model turns per episode"),
    # adv/
    Metric("adv/mean", "Mean advantage over the sequences counted in their group's baseline (per-token: their loss "
           "tokens; whitened over every rank's, so near 0 but not 0 on one rank)"),
    Metric("adv/std", "Standard deviation of those advantages"),
    Metric("adv/abs_max", "Largest absolute advantage"),
    Metric("adv/zero_std_group_frac", "Share of groups whose rewards all tie: no reward signal under a group baseline "
           "(their advantages are 0, or under reinforce_pp_baseline only the whitening's shift and the KL's), a reward "
           "above or below the batch's under reinforce_pp"),
    Metric("adv/valid_frac", "Share of sequences counted in their group's baseline (below 1 only with "
           "`algo.correction.rejected_in_baseline=false` and rejected sequences)"),
    # dynamic/
    Metric("dynamic/rounds", "Rollout rounds the step ran (1 = the first round was enough)", DYNAMIC),
    Metric("dynamic/prompts_drawn", "Prompts rolled out over those rounds (`trainer.prompts_per_step` in the first)",
           DYNAMIC),
    Metric("dynamic/informative_frac", "Share of those prompts whose group had a learning signal: some sample in "
           "the loss with a non-zero advantage", DYNAMIC),
    Metric("dynamic/groups", "Groups the step trained on (`trainer.prompts_per_step` when the target was reached; "
           "fewer after `max_rounds`, a multiple of the data-parallel size)", DYNAMIC),
    Metric("dynamic/target_reached", "1 when the rounds found `trainer.prompts_per_step` informative groups, else 0",
           DYNAMIC),
    # overlong/
    Metric("overlong/masked_frac", "Share of the trained samples left out of the loss because their last model turn "
           "was cut by a length limit (they still count in their group's baseline)", "`algo.overlong.mask=true`"),
    Metric("overlong/penalty_mean", "Mean soft overlong penalty subtracted from the rewards (DAPO's ramp over the "
           "last `algo.overlong.buffer` tokens of `rollout.max_new_tokens`, times `algo.overlong.penalty`)",
           "`algo.overlong.penalty > 0`"),
    # actor/
    Metric("actor/loss", "The loss: policy-gradient term + `algo.kl.coef` x KL term - `algo.entropy_coef` x entropy "
           "(SFT: mean cross-entropy per target token)", SFT),
    Metric("actor/pg_loss", "The policy-gradient term (`algo.policy_loss`, with the correction's weights and mask)"),
    Metric("actor/kl", "The KL term: KL estimate (`algo.kl.estimator`) of the policy to the reference, aggregated "
           "as the loss is, before `algo.kl.coef`", "`algo.kl.coef > 0`, `algo.kl.mode=loss`"),
    Metric("actor/entropy", "Mean entropy of the policy's next-token distribution on response tokens (aggregated as the loss is)"),
    Metric("actor/clip_frac", "Share of response tokens whose ratio pi/pi_old was clipped (no gradient under PPO; "
           "under GSPO the tokens of the sequences whose sequence ratio was)"),
    Metric("actor/clip_frac_low", "Share clipped below at 1 - `algo.clip_low` (negative advantage under PPO)"),
    Metric("actor/clip_frac_high", "Share clipped above at 1 + `algo.clip_high` (positive advantage under PPO)"),
    Metric("actor/dual_clip_frac", "Share of negative-advantage tokens whose loss the dual clip bounded",
           "`algo.dual_clip` set"),
    Metric("actor/ratio_mean", "Mean ratio pi/pi_old on response tokens (1 on the first optimizer step of a rollout)"),
    Metric("actor/approx_kl", "k3 estimate of KL(pi_old || pi) on response tokens: how far the update moved the policy"),
    Metric("actor/grad_norm", "Gradient norm before clipping to `actor.max_grad_norm`, mean over the applied optimizer steps",
           SFT),
    Metric("actor/no_grad_seq_frac", "Share of the update's sequences whose group's rewards all tie (advantage 0) and "
           "whose forward ran without autograd, skipped in backward",
           "`actor.skip_zero_advantage=true` where it applies (no KL term in the loss, no entropy bonus)"),
    Metric("actor/skipped_steps", "Optimizer steps skipped for a non-finite loss or gradient norm"),
    Metric("actor/lr", "Learning rate after the step's optimizer steps", SFT),
    Metric("actor/target_prob", "Mean probability of the target tokens before the step (a smooth token accuracy)", "SFT only"),
    # reward_model/
    Metric("reward_model/score_mean", "Mean reward-model score of the step's scored samples", LEARNED),
    Metric("reward_model/score_std", "Standard deviation of those scores", LEARNED),
    Metric("reward_model/env_reward_mean", "Mean env reward of the same samples, before the score replaced it or was "
           "added to it (`env.reward_model.mode`)", LEARNED),
    # critic/
    Metric("critic/value_loss", "The value loss: 0.5 x squared error of the values to their targets (the GAE returns), "
           "the larger of the clipped and unclipped errors (`critic.clip`), aggregated as `algo.loss_agg`", CRITIC),
    Metric("critic/clip_frac", "Share of loss tokens where the clipped value's error was the larger (no gradient "
           "there)", CRITIC),
    Metric("critic/explained_var", "1 - Var(return - value) / Var(return) of the values GAE read (1: exact, 0: no "
           "better than the mean)", CRITIC),
    Metric("critic/value_mean", "Mean value of the loss tokens' states, before the update", CRITIC),
    Metric("critic/return_mean", "Mean target (GAE return) of the loss tokens", CRITIC),
    Metric("critic/grad_norm", "The critic's gradient norm before clipping to `critic.max_grad_norm`, mean over the "
           "applied optimizer steps", CRITIC),
    Metric("critic/skipped_steps", "The critic's optimizer steps skipped for a non-finite loss or gradient norm", CRITIC),
    Metric("critic/lr", "The critic's learning rate after the step's optimizer steps", CRITIC),
    # mismatch/
    Metric("mismatch/kl", "Mean of logp_sparse - logp_old per token: a k1 estimate of KL(sampler || dense policy)"),
    Metric("mismatch/k3_kl", "Mean of xi - 1 - log xi per token: the k3 estimate of the same KL (non-negative)"),
    Metric("mismatch/abs_mean", "Mean |log xi| per token"),
    Metric("mismatch/abs_max", "Largest |log xi| of any token"),
    Metric("mismatch/log_ppl_sparse", "Mean over sequences of the sampler's per-token negative log-likelihood"),
    Metric("mismatch/log_ppl_dense", "Mean over sequences of the dense policy's per-token negative log-likelihood"),
    Metric("mismatch/log_ppl_diff", "`mismatch/log_ppl_sparse` - `mismatch/log_ppl_dense`"),
    Metric("mismatch/low_xi_frac", "Share of response tokens with xi < 0.1 (the dense policy finds them 10x less likely)"),
    Metric("mismatch/low_xi_pos_adv_frac", "The same share among tokens of positive-advantage sequences, where an "
           "uncorrected update pushes hardest"),
    Metric("mismatch/xi_p01", "1st percentile of xi = p_dense / p_sparse over the response tokens of the batch "
           "trained on, length-cut ones included, all ranks (from a histogram of log xi: exact to ~0.2% inside "
           "[0.0067, 148])"),
    Metric("mismatch/xi_p05", "5th percentile of xi over the response tokens of the batch trained on, all ranks "
           "(the trained batch's; the controller reads `sampler/xi_p05`)"),
    # sampler/
    Metric("sampler/xi_p05", "5th percentile of xi over every sampled token scored densely, before any filter: the "
           "tail statistic `rollout.kv.budget=auto` keeps at or above `rollout.kv.control.target`"),
    Metric("sampler/xi_p01", "1st percentile of the same (`rollout.kv.control.statistic=xi_p01` steers by it)"),
    Metric("sampler/low_xi_frac", "Share of those tokens with xi < 0.1"),
    Metric("sampler/rejected_seq_frac", "Share of the scored sequences the correction rejects whole (what "
           "`correction/rejected_seq_frac` would read before dynamic sampling and the rescue)", CORRECTION),
    Metric("sampler/seqs", "Sequences scored densely this step (every round), all ranks"),
    Metric("sampler/tokens", "Their sampled tokens, all ranks"),
    # correction/
    Metric("correction/kept_token_frac", "Share of response tokens that keep their place in the loss", CORRECTION),
    Metric("correction/masked_low_frac", "Share of tokens masked for xi below `algo.correction.token_low`", CORRECTION),
    Metric("correction/masked_high_frac", "Share of tokens masked for xi above `algo.correction.token_high`", CORRECTION),
    Metric("correction/truncated_frac", "Share of tokens whose weight was capped at `algo.correction.is_cap`", CORRECTION),
    Metric("correction/rejected_seq_frac", "Share of sequences rejected whole (veto or geometric-mean bounds)", CORRECTION),
    Metric("correction/veto_seq_frac", "Share of sequences vetoed: some token's xi below `algo.correction.veto`", CORRECTION),
    Metric("correction/geo_rejected_seq_frac", "Share of sequences whose geometric-mean xi is outside "
           "[`geo_low`, `geo_high`]", CORRECTION),
    Metric("correction/weight_mean", "Mean importance weight of the kept tokens, after normalization", CORRECTION),
    Metric("correction/weight_min", "Smallest weight of a kept token, after normalization", CORRECTION),
    Metric("correction/weight_max", "Largest weight of a kept token, after normalization", CORRECTION),
    Metric("correction/norm_factor", "The divisor of the batch normalization (`is_batch_normalize`; 1 when off)", CORRECTION),
    Metric("correction/ess", "Effective sample size of the kept tokens' weights as a share of their number "
           "((sum w)^2 / (n sum w^2); 1 = uniform)", CORRECTION),
    # rescue/
    Metric("rescue/rejected_before_frac", "Share of the batch's sequences the correction rejected before the rescue "
           "(what `correction/rejected_seq_frac` would be without it; over every scored sample: "
           "`sampler/rejected_seq_frac`)", RESCUE),
    Metric("rescue/seqs", "Sequences re-rolled densely (one per rejected sequence, every sample of a group re-rolled "
           "whole by `algo.correction.rescue_group_frac`), all ranks", RESCUE),
    Metric("rescue/frac", "`rescue/seqs` as a share of the batch's sequences", RESCUE),
    Metric("rescue/reward_mean", "Mean reward of the re-rolled samples", f"{RESCUE}, steps with `rescue/seqs > 0`"),
    # kv/
    Metric("kv/retained_frac", "KV entries the samples held at their end / what a dense cache would hold (1 when dense)"),
    Metric("kv/compressions", "KV compressions run (`rollout.kv.*`), all ranks"),
    Metric("kv/budget", "The KV budget this step's rollouts compressed to (chosen by the controller from the "
           "previous steps' `kv/budget_tail`)", "`rollout.kv.budget=auto`"),
    Metric("kv/budget_tail", "The tail statistic the controller read this step to choose the next budget: "
           "`sampler/<rollout.kv.control.statistic>`, the sampler's own before any filter", "`rollout.kv.budget=auto`"),
    Metric("kv/compress_s", "Seconds spent compressing, summed over ranks"),
    Metric("kv/peak_slots", "Most KV slots (per layer) in use at once in one engine, max over ranks"),
    Metric("kv/peak_gb", "Those slots in GiB (all layers, K and V), max over ranks"),
    Metric("kv/peak_running", "Most sequences decoding at once in one engine, max over ranks"),
    Metric("kv/retractions", "Running sequences the native engine retracted when its KV pool ran out (their slots "
           "freed, prefilled again later: `rollout.admission=optimistic`), all ranks",
           "`rollout.kv_memory` or `rollout.kv_pool_tokens` set (0 with SGLang, whose retractions are its own)"),
    Metric("kv/recomputed_tokens", "Tokens whose KV those retractions threw away and a re-prefill computed again, "
           "all ranks", "`rollout.kv_memory` or `rollout.kv_pool_tokens` set"),
    Metric("kv/pool_size", "Slots of the SGLang engine's KV pool", "`rollout.engine=sglang` with KV compression"),
    Metric("kv/pool_free_after", "Free slots once the rollout finished (equals `kv/pool_size`, or the run stops with a "
           "leak error)", "`rollout.engine=sglang` with KV compression"),
    Metric("kv/query_buffer_mb", "MiB of the ring of recent queries that R-KV / SnapKV score with",
           "`rollout.engine=sglang` with KV compression"),
    Metric("kv/host_syncs", "Host syncs of the KV bookkeeping", "`rollout.engine=sglang`, SGLang option kv_count_syncs"),
    Metric("kv/decode_forwards", "Decode forwards those syncs were counted over", "`rollout.engine=sglang`, SGLang option kv_count_syncs"),
    # partial/
    Metric("partial/carried_frac", "Share of the trained samples that were carried across at least one step boundary",
           PARTIAL),
    Metric("partial/trained_samples", "Samples trained this step (the groups whose samples all ended)", PARTIAL),
    Metric("partial/in_flight", "Samples carried into the next step", PARTIAL),
    Metric("partial/calls", "Engine calls of the step's rollout, summed over ranks (a rank calls again, under the same "
           "weights, while none of its groups has ended)", PARTIAL),
    Metric("partial/tokens_age<age>", "Share of the trained model tokens drawn <age> steps before this one (0 to "
           "`rollout.partial.max_staleness`)", PARTIAL),
    Metric("partial/mismatch_kl_age<age>", "`mismatch/kl` over the tokens of that age: mean logp_sparse - logp_old, "
           "each token's sampler log-prob against this step's dense policy", PARTIAL + ", tokens of that age"),
    # rollout/
    Metric("rollout/weight_bytes", "Bytes of the native engine's weights (smaller with `rollout.quantization`)",
           "`rollout.engine=native`"),
    Metric("rollout/weight_bytes_saved", "Bytes the quantization saves against unquantized weights in `rollout.dtype`",
           "`rollout.engine=native`"),
    Metric("rollout/kv_mismatch_kl", "KV compression's share of `mismatch/kl`: mean of logp_sparse - the engine's own "
           "dense log-prob over the re-scored tokens", "`rollout.rescore_seqs > 0`"),
    Metric("rollout/rescored_tokens", "Tokens re-scored densely for `rollout/kv_mismatch_kl`", "`rollout.rescore_seqs > 0`"),
    Metric("rollout/graph_captures", "Decode steps captured as CUDA graphs since the engine's stats were reset (a batch-size "
           "bucket's first use, and again after sleep, a weight release or a wider slot table)",
           "`rollout.engine=native`"),
    Metric("rollout/graph_capture_s", "Seconds those captures took (each: a synchronize, a warm-up forward and the "
           "capture), since the engine's stats were reset", "`rollout.engine=native`"),
    # perf/
    Metric("perf/step_s", "Seconds of the whole step on rank 0", SFT),
    Metric("perf/<phase>_s", "Seconds rank 0 spent in the phase (phases below)", "the steps that run the phase"),
    Metric("perf/rollout_tok_s", "Tokens generated per second: new tokens of all ranks / the slowest rank's rollout seconds"),
    Metric("perf/train_tok_s", "Tokens trained on per second: the batch's tokens on all ranks / the slowest rank's "
           "update seconds", SFT),
    Metric("perf/dp_load_imbalance_before", ("Most update work on one data-parallel rank / the mean, before balancing (tokens; a "
                                            "trained token counts 3-4 times a zero-advantage one where the actor skips "
                                            "their backward)"),
           "`actor.balance_ranks=true`, 2+ data-parallel ranks"),
    Metric("perf/dp_load_imbalance", "The same after `actor.balance_ranks` moved sequences between ranks",
           "`actor.balance_ranks=true`, 2+ data-parallel ranks"),
    # mem/
    Metric("mem/peak_gb", "Rank 0's peak memory so far in the run"),
    Metric("mem/peak_gb_max_rank", "The largest `mem/peak_gb` of any data-parallel rank"),
    Metric("mem/rss_gb", "Rank 0's resident memory at the end of the step"),
    Metric("mem/<phase>_peak_gb", "Rank 0's peak memory during the phase", "the steps that run the phase"),
    Metric("mem/<phase>_end_gb", "Rank 0's memory in use when the phase ended", "the steps that run the phase"),
    # eval/
    Metric("eval/time_s", "Seconds the evaluation took, all sets", "`trainer.eval_every > 0`"),
    Metric("eval/<set>/prompts", "Prompts evaluated (`eval.limit` caps them)", "`trainer.eval_every > 0`"),
    Metric("eval/<set>/avg@<n>", "Mean accuracy of one sample, n = `eval.n`", "`trainer.eval_every > 0`"),
    Metric("eval/<set>/pass@<k>", "Unbiased pass@k: chance that one of k samples is correct, per k of `eval.k`",
           "`trainer.eval_every > 0`"),
    Metric("eval/<set>/maj@<n>", "Accuracy of the majority-voted answer of the n samples",
           "`trainer.eval_every > 0`, an env with `extract_answer`"),
    Metric("eval/<set>/response_len", "Mean response length in tokens", "`trainer.eval_every > 0`"),
    Metric("eval/<set>/truncated_frac", "Share of samples cut at `eval.max_new_tokens`", "`trainer.eval_every > 0`"),
    Metric("eval/<set>/kv_retained_frac", "KV entries held at the end / a dense cache's (1 when dense)",
           "`trainer.eval_every > 0`"),
    Metric("eval/<set>/kv_peak_tokens", "Mean over samples of the most KV entries (per layer) a sample held at once",
           "`trainer.eval_every > 0`"),
    Metric("eval/<set>/kv_peak_tokens_max", "The largest of those peaks", "`trainer.eval_every > 0`"),
    Metric("eval/<set>/kv_peak_mib", "`kv_peak_tokens` in MiB (all layers, K and V)",
           "`trainer.eval_every > 0`, an engine that reports its bytes per slot"),
    # openreward/, tool/
    Metric("openreward/<env>/samples", "Samples of the environment this step (`<env>`: Org/Name with `/` as `_`)",
           "`env.openreward.envs` set"),
    Metric("openreward/<env>/reward_mean", "Mean reward of those samples", "`env.openreward.envs` set"),
    *(Metric(f"tool/{counter}_mean", f"Mean per sample of {what}", "`env.openreward.envs` set")
      for counter, what in TOOL_COUNTERS.items()),
    # rm/, dpo/ (the preference trainers)
    Metric("rm/loss", "Bradley-Terry loss -log sigmoid(r_chosen - r_rejected)", "python -m sparserl.trainer.rm"),
    Metric("eval/rm/loss", "Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), on the held-out pairs", "python -m sparserl.trainer.rm: before the first step, every `rm.eval_every` steps and after the last"),
    Metric("rm/accuracy", "Share of pairs whose chosen response scores strictly higher", "python -m sparserl.trainer.rm"),
    Metric("eval/rm/accuracy", "Share of pairs whose chosen response scores strictly higher, on the held-out pairs", "python -m sparserl.trainer.rm: before the first step, every `rm.eval_every` steps and after the last"),
    Metric("rm/margin", "Mean score difference r_chosen - r_rejected", "python -m sparserl.trainer.rm"),
    Metric("eval/rm/margin", "Mean score difference r_chosen - r_rejected, on the held-out pairs", "python -m sparserl.trainer.rm: before the first step, every `rm.eval_every` steps and after the last"),
    Metric("rm/chosen_score", "Mean score of the chosen responses", "python -m sparserl.trainer.rm"),
    Metric("eval/rm/chosen_score", "Mean score of the chosen responses, on the held-out pairs", "python -m sparserl.trainer.rm: before the first step, every `rm.eval_every` steps and after the last"),
    Metric("rm/rejected_score", "Mean score of the rejected responses", "python -m sparserl.trainer.rm"),
    Metric("eval/rm/rejected_score", "Mean score of the rejected responses, on the held-out pairs", "python -m sparserl.trainer.rm: before the first step, every `rm.eval_every` steps and after the last"),
    Metric("dpo/loss", "The `dpo.loss` objective (sigmoid DPO or IPO) per pair", "python -m sparserl.trainer.dpo"),
    Metric("eval/dpo/loss", "The `dpo.loss` objective (sigmoid DPO or IPO) per pair, on the held-out pairs", "python -m sparserl.trainer.dpo: before the first step, every `dpo.eval_every` steps and after the last"),
    Metric("dpo/accuracy", "Share of pairs whose chosen reward is strictly the higher", "python -m sparserl.trainer.dpo"),
    Metric("eval/dpo/accuracy", "Share of pairs whose chosen reward is strictly the higher, on the held-out pairs", "python -m sparserl.trainer.dpo: before the first step, every `dpo.eval_every` steps and after the last"),
    Metric("dpo/margin", "Mean chosen reward minus rejected reward", "python -m sparserl.trainer.dpo"),
    Metric("eval/dpo/margin", "Mean chosen reward minus rejected reward, on the held-out pairs", "python -m sparserl.trainer.dpo: before the first step, every `dpo.eval_every` steps and after the last"),
    Metric("dpo/chosen_reward", "Mean beta (logp - logp_ref) of the chosen responses", "python -m sparserl.trainer.dpo"),
    Metric("eval/dpo/chosen_reward", "Mean beta (logp - logp_ref) of the chosen responses, on the held-out pairs", "python -m sparserl.trainer.dpo: before the first step, every `dpo.eval_every` steps and after the last"),
    Metric("dpo/rejected_reward", "Mean beta (logp - logp_ref) of the rejected responses", "python -m sparserl.trainer.dpo"),
    Metric("eval/dpo/rejected_reward", "Mean beta (logp - logp_ref) of the rejected responses, on the held-out pairs", "python -m sparserl.trainer.dpo: before the first step, every `dpo.eval_every` steps and after the last"),
    Metric("dpo/chosen_logp", "Mean summed log-prob of the chosen responses under the policy", "python -m sparserl.trainer.dpo"),
    Metric("eval/dpo/chosen_logp", "Mean summed log-prob of the chosen responses under the policy, on the held-out pairs", "python -m sparserl.trainer.dpo: before the first step, every `dpo.eval_every` steps and after the last"),
    Metric("dpo/rejected_logp", "Mean summed log-prob of the rejected responses under the policy", "python -m sparserl.trainer.dpo"),
    Metric("eval/dpo/rejected_logp", "Mean summed log-prob of the rejected responses under the policy, on the held-out pairs", "python -m sparserl.trainer.dpo: before the first step, every `dpo.eval_every` steps and after the last"),
)

# Metric-shaped names in the code that never reach metrics.jsonl: what each becomes.
INTERNAL: dict[str, str] = {
    "openreward/<env>/count": "summed over ranks into `openreward/<env>/samples`",
    "openreward/<env>/reward_sum": "summed over ranks into `openreward/<env>/reward_mean`",
    "env/aborted_frac": "the rollout worker's per-rank summary (samples whose generation the engine aborted)",
    "response/model_tokens_mean": "the rollout worker's per-rank summary (tokens the model wrote, without env observations)",
    "perf/weight_sync_gb": "returned by `sync_weights` (GiB handed to the engine; benchmarks/host_memory.py prints it); "
                           "the trainer logs the sync's time as `perf/weight_sync_s`",
}

PLACEHOLDERS: dict[str, str] = {
    "<set>": r"[^/]+",  # an eval set's name (eval.datasets)
    "<env>": r"[^/]+",  # an OpenReward environment, Org_Name
    "<n>": r"\d+",
    "<k>": r"\d+",
    "<age>": r"\d+",
    "<phase>": "|".join(PHASES),
}


def pattern(name: str) -> re.Pattern:
    """The regular expression of a registry name: its placeholders as `PLACEHOLDERS` says, the rest literal."""
    parts = re.split(r"(<[a-z]+>)", name)
    return re.compile("".join(f"(?:{PLACEHOLDERS[p]})" if p in PLACEHOLDERS else re.escape(p) for p in parts))


_COMPILED = [(m, pattern(m.name)) for m in METRICS]


def find(key: str) -> Metric | None:
    """The entry documenting the logged key `key` (an exact entry before a family), or None."""
    for m, rx in _COMPILED:
        if m.name == key:
            return m
    return next((m for m, rx in _COMPILED if rx.fullmatch(key)), None)


def group_of(name: str) -> str:
    return name.split("/", 1)[0]

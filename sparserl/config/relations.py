"""The config checks that relate keys of different groups: `CROSS_CHECKS`, fn(cfg), run by
`sparserl/config/checks.py:check_config` after every group has passed its own rules. (Keys of one group are related
by the group class's `RELATIONS`, beside its fields.) Each raises one `ConfigError` naming the keys and the way
out. Plain Python: no torch.
"""
from __future__ import annotations

from typing import Any, Callable

from sparserl.config.partial import cross_check as partial_cross_check
from sparserl.config.fields import ConfigError, show


def _dual_clip_is_ppo(cfg) -> None:
    if cfg.algo.dual_clip is not None and cfg.algo.policy_loss != "ppo":
        raise ConfigError(f"algo.dual_clip={show(cfg.algo.dual_clip)} is a PPO option; set algo.dual_clip=null with "
                          f"algo.policy_loss={cfg.algo.policy_loss}")


# The advantage estimators that give one advantage per token (sparserl/algo/advantages.py `Estimator.per_token`;
# tests/unit/test_advantages.py keeps the two equal): named here, as this module imports no torch.
PER_TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")
# The estimators that read a critic's values (`Estimator.uses_values`; the same test keeps the two equal).
VALUE_ESTIMATORS = ("gae",)


def _objective_fits(cfg) -> None:
    a = cfg.algo
    if a.adv_estimator == "rloo" and cfg.rollout.n < 2:
        raise ConfigError(f"algo.adv_estimator=rloo with rollout.n={cfg.rollout.n}: the leave-one-out baseline needs "
                          "another sample of the prompt; set rollout.n >= 2")
    if a.policy_loss == "gspo" and a.adv_estimator in VALUE_ESTIMATORS:
        raise ConfigError(f"algo.policy_loss=gspo takes one advantage per sequence, but algo.adv_estimator="
                          f"{a.adv_estimator} gives one per token; use algo.policy_loss=gspo_token")
    if a.policy_loss == "gspo" and a.adv_estimator in PER_TOKEN_ESTIMATORS and a.kl.coef > 0 and a.kl.mode == "reward":
        raise ConfigError(f"algo.policy_loss=gspo takes one advantage per sequence, but algo.adv_estimator="
                          f"{a.adv_estimator} with the KL in the reward (algo.kl.mode=reward) gives one per token; use "
                          "algo.policy_loss=gspo_token")


def _critic_is_read(cfg) -> None:
    a, on = cfg.algo, cfg.critic.enable
    if a.adv_estimator in VALUE_ESTIMATORS and not on:
        raise ConfigError(f"algo.adv_estimator={a.adv_estimator} reads a critic's values, but critic.enable=false; set "
                          "critic.enable=true (or +preset=ppo)")
    if on and a.adv_estimator not in VALUE_ESTIMATORS:
        raise ConfigError(f"critic.enable=true with algo.adv_estimator={a.adv_estimator}, which reads no values: the "
                          f"critic would train for nothing; use algo.adv_estimator={VALUE_ESTIMATORS[0]} or "
                          "critic.enable=false")


def _nccl_needs_cuda(cfg) -> None:
    if cfg.parallel.backend == "nccl" and cfg.parallel.device == "cpu":
        raise ConfigError("parallel.backend=nccl needs parallel.device=cuda (or auto on a GPU machine); use gloo on CPU")


def _quantization_device(cfg) -> None:
    # parallel.device=auto is checked again where the device is known (engines/native/quantize.py check_scheme).
    q = cfg.rollout.quantization
    if q in ("w8a8", "fp8") and cfg.parallel.device == "cpu":
        why = ("torch has no fast int8 x int8 matmul on CPU; use int8 (weight-only)" if q == "w8a8"
               else "fp8 weights need a GPU; use int8")
        raise ConfigError(f"rollout.quantization={q} is not supported with parallel.device=cpu: {why}")


def _prepack_applies(cfg) -> None:
    # What is known only once the model and device are (rollout.dtype=auto, parallel.device=auto) is checked again
    # where the engine starts (engines/native/prepack.py resolve_prepack).
    r = cfg.rollout
    if r.prepack in ("auto", "off"):
        return
    why = ("it packs the native engine's GEMMs" if r.engine != "native" else
           "the packed GEMMs (oneDNN's, MKL's) are CPU kernels" if cfg.parallel.device == "cuda" else
           "it packs float32 weights" if r.dtype not in ("auto", "float32", "fp32") else
           "quantized layers have their own kernels" if r.quantization != "none" else "")
    if why:
        raise ConfigError(f"rollout.prepack={r.prepack} with rollout.engine={r.engine}, parallel.device={cfg.parallel.device}, "
                          f"rollout.dtype={r.dtype}, rollout.quantization={r.quantization}: {why}; use auto or off")


def _kv_memory_fraction_device(cfg) -> None:
    # parallel.device=auto on a machine without CUDA is checked again where the pool is sized (engine_options/build.py).
    from sparserl.utils.kv_memory import parse_kv_memory  # plain Python

    if parse_kv_memory(cfg.rollout.kv_memory).fraction > 0 and cfg.parallel.device == "cpu":
        raise ConfigError(f"rollout.kv_memory={cfg.rollout.kv_memory} is a fraction of the free device memory, which "
                          "needs parallel.device=cuda; give a size on CPU (e.g. rollout.kv_memory=512MB)")


def _sglang_tp_shares_heads(cfg) -> None:
    kv = cfg.rollout.kv
    if cfg.rollout.engine == "sglang" and cfg.parallel.tp > 1 and kv.algorithm != "none" and kv.share != "head":
        raise ConfigError(f"rollout.kv.share={kv.share} with rollout.engine=sglang and parallel.tp={cfg.parallel.tp}: each "
                          "tensor-parallel rank holds only its KV heads, so one set per layer would need the ranks to "
                          "agree; use rollout.kv.share=head, parallel.tp=1 or rollout.engine=native")


def _overlong_fits(cfg) -> None:
    o, cap = cfg.algo.overlong, cfg.rollout.max_new_tokens
    if o.penalty > 0 and o.buffer > cap:
        raise ConfigError(f"algo.overlong.buffer={o.buffer} must be <= rollout.max_new_tokens={cap}: the penalty ramps "
                          "over the last buffer tokens of the length cap")


def _lora_dropout_tp(cfg) -> None:
    lora, tp = cfg.actor.lora, cfg.parallel.tp
    if lora.rank > 0 and lora.dropout > 0 and tp > 1:
        raise ConfigError(f"actor.lora.dropout={lora.dropout} with parallel.tp={tp}: each tensor-parallel rank would "
                          "draw its own dropout mask for the same adapter input (actor/lora.py); set actor.lora.dropout=0")


def _cp_engine(cfg) -> None:
    if cfg.parallel.cp > 1 and cfg.rollout.engine == "sglang":
        raise ConfigError(f"parallel.cp={cfg.parallel.cp} with rollout.engine=sglang: an SGLang engine spans one "
                          "tensor-parallel group, not a data-parallel rank's cp x tp ranks; use rollout.engine=native "
                          "or parallel.cp=1")


def _auto_budget_engine(cfg) -> None:
    kv = cfg.rollout.kv
    if kv.budget == "auto" and kv.algorithm == "none":
        raise ConfigError("rollout.kv.budget=auto with rollout.kv.algorithm=none: there is no compression to control; "
                          "choose a policy (rkv, snapkv, streaming) or a number")
    if kv.budget == "auto" and cfg.rollout.engine == "sglang":
        raise ConfigError("rollout.kv.budget=auto with rollout.engine=sglang: the SGLang backend takes its budget at "
                          "start-up; use rollout.engine=native or a fixed rollout.kv.budget")


def _rescue_dense(cfg) -> None:
    c = cfg.algo.correction
    if c.rescue == "none":
        if c.rescue_group_frac > 0:
            raise ConfigError(f"algo.correction.rescue_group_frac={c.rescue_group_frac:g} re-rolls whole groups of the "
                              "rescue, but algo.correction.rescue=none; set algo.correction.rescue=dense or "
                              "rescue_group_frac=0")
        return
    if not (c.enable and c.mode == "apply"):
        raise ConfigError(f"algo.correction.rescue={c.rescue} re-rolls the sequences the correction rejects, but with "
                          f"algo.correction.enable={str(c.enable).lower()} and algo.correction.mode={c.mode} it rejects "
                          "none; set algo.correction.enable=true and algo.correction.mode=apply, or rescue=none")
    if cfg.rollout.engine == "sglang":
        raise ConfigError(f"algo.correction.rescue={c.rescue} with rollout.engine=sglang: the SGLang backend takes its "
                          "KV compression at start-up and cannot generate one batch densely; use rollout.engine=native "
                          "or algo.correction.rescue=none")


def _openreward(cfg) -> None:
    from sparserl.rollout.openreward.spec import parse_envs  # plain Python: no SDK, no torch

    o = cfg.env.openreward
    specs = parse_envs(o.envs)
    if not specs and (o.serve or o.base_url):
        raise ConfigError(f"env.openreward.{'serve' if o.serve else 'base_url'} is set but env.openreward.envs is empty: "
                          "name the environments to train on ('env.openreward.envs={Org/Name: {}}')")
    if o.serve and o.base_url:
        raise ConfigError(f"env.openreward.serve={o.serve} and env.openreward.base_url={o.base_url}: give one (a served "
                          "file gets its own local URL)")
    if specs and cfg.data.train_path:
        raise ConfigError(f"data.train_path={cfg.data.train_path} and env.openreward.envs are both set: OpenReward tasks "
                          "are the prompts; clear one of them")


# Checks relating keys of different groups: fn(cfg), run by check_config after every group.
CROSS_CHECKS: tuple[Callable[[Any], None], ...] = (_dual_clip_is_ppo, _objective_fits, _critic_is_read, _nccl_needs_cuda, _quantization_device,
                                                   _prepack_applies, _kv_memory_fraction_device,
                                                   _sglang_tp_shares_heads, _overlong_fits,
                                                   _auto_budget_engine, _lora_dropout_tp, _cp_engine, _rescue_dense, _openreward,
                                                   partial_cross_check)

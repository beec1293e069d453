"""Every bad input to `python -m sparserl.trainer.grpo` is one `error:` line, exit code 2, before any work.

Each case runs the real command line in a subprocess; the cases run in parallel threads, and most fail
before torch is imported (about half a second of CPU each). Each asserts: exit code 2, exactly one `error:`
line on stderr naming the key or file, no traceback, no output folder. The drift tests below keep the rule
table (sparserl/config/checks.py) equal to the schema and to the registries it mirrors, and make sure every
rule has a case here. `--help` and `--cfg job` exit 0.
"""
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from sparserl.config.load import RENAMED, leaf_keys
from sparserl.config.checks import FREE, RANGES, RULES
from tests.launch import command

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # ~180 command lines (the module's set-up: about 2 minutes on the CI machine)
WORKERS = 4  # subprocesses at once: most of their time is interpreter start-up and imports
SLOW = ("chat_template_rejects", "model_path_file", "model_path_missing", "openreward_serve_class")  # they import torch: started first

REJECTING_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                      "{{ raise_exception('System role not supported') }}{% endif %}"
                      "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")

# (case id, overrides; {data} is the folder of the files below, {ckpt} a checkpoint whose chat template
#  rejects system messages; what the error line must contain)
CASES = [
    # data files
    ("empty_jsonl", ["data.train_path={data}/empty.jsonl"], "empty.jsonl: the file is empty"),
    ("blank_lines_jsonl", ["data.train_path={data}/blank.jsonl"], "blank.jsonl: the file is empty"),
    ("invalid_json_line", ["data.train_path={data}/bad_json.jsonl"], "bad_json.jsonl line 2: invalid JSON"),
    ("binary_jsonl", ["data.train_path={data}/binary.jsonl"], "binary.jsonl line 1: not UTF-8 text"),
    ("latin1_jsonl", ["data.train_path={data}/latin1.jsonl"], "latin1.jsonl line 2: not UTF-8 text, byte 0xe9"),
    ("nul_byte_jsonl", ["data.train_path={data}/nul.jsonl"], "nul.jsonl line 1: binary data"),
    ("jsonl_line_not_object", ["data.train_path={data}/array_line.jsonl"], "array_line.jsonl line 1: a JSON object is expected"),
    ("json_array_broken", ["data.train_path={data}/broken.json"], "broken.json line 2: invalid JSON"),
    ("prompt_wrong_type", ["data.train_path={data}/prompt_int.jsonl"], "prompt_int.jsonl row 1: 'prompt': a string or a list"),
    ("prompt_missing", ["data.train_path={data}/no_prompt.jsonl"], "no_prompt.jsonl row 0: no 'prompt' or 'messages' field"),
    ("answer_wrong_type", ["data.train_path={data}/answer_dict.jsonl"], "answer_dict.jsonl row 0: 'answer' must be a string"),
    ("answer_missing", ["data.train_path={data}/no_answer.jsonl"], "no_answer.jsonl row 1: no 'answer' field"),
    ("answer_key_wrong", ["data.train_path={data}/ok.jsonl", "data.answer_key=label"], "ok.jsonl row 0: no 'label' field"),
    ("message_content_int", ["data.train_path={data}/bad_messages.jsonl"], "bad_messages.jsonl row 0: 'prompt': message 0"),
    ("csv_extra_field", ["data.train_path={data}/extra.csv"], "extra.csv line 3: 3 fields but the header names 2"),
    ("csv_open_quote", ["data.train_path={data}/open_quote.csv"], "open_quote.csv line 2: not valid CSV"),
    ("csv_no_prompt_column", ["data.train_path={data}/question.csv"], "question.csv row 0: no 'prompt'"),
    ("not_parquet", ["data.train_path={data}/fake.parquet"], "fake.parquet: not a Parquet file"),
    ("parquet_prompt_int", ["data.train_path={data}/prompt_int.parquet"], "prompt_int.parquet row 0: 'prompt'"),
    ("unknown_extension", ["data.train_path={data}/notes.txt"], "notes.txt: unknown file type"),
    ("missing_data_file", ["data.train_path={data}/nope.jsonl"], "data.train_path={data}/nope.jsonl: no such file"),
    ("chat_template_rejects", ["data.train_path={data}/system.jsonl", "model.path={ckpt}", "model.compute_dtype=float32",
                               "rollout.dtype=float32"], "system.jsonl row 1: the tokenizer's chat template rejects it"),
    # paths and the command line
    ("model_path_file", ["model.path=/etc/passwd"], "model.path=/etc/passwd"),
    ("model_path_missing", ["model.path={data}/no_model"], "model.path={data}/no_model"),
    ("env_not_python", ["env.path=/etc/passwd"], "env.path=/etc/passwd"),
    ("env_missing", ["env.path={data}/nope.py"], "env.path="),
    ("dp_replicate_not_dividing", ["parallel.dp_replicate=2"], "parallel.dp_replicate=2 must divide the data-parallel size 1"),
    ("reward_model_not_a_model", ["env.reward_model.path={data}"], "env.reward_model.path={data}: not a model folder"),
    ("reward_model_causal_lm", ["env.reward_model.path={ckpt}"], "labels, not a reward model"),
    ("output_dir_proc", ["trainer.output_dir=/proc/nope"], "trainer.output_dir=/proc/nope: cannot create a folder in /proc"),
    ("output_dir_is_file", ["trainer.output_dir={data}/ok.jsonl"], "trainer.output_dir={data}/ok.jsonl: a file is there"),
    ("output_dir_under_file", ["trainer.output_dir={data}/ok.jsonl/run"], "ok.jsonl is a file"),
    ("resume_missing", ["trainer.resume={data}/no_ckpt"], "trainer.resume={data}/no_ckpt: not a complete"),
    ("unknown_key", ["actor.lrr=1"], "did you mean actor.lr"),
    ("wrong_type", ["actor.lr=abc"], "actor.lr=abc: actor.lr wants a number, e.g. actor.lr=5e-06"),
    ("no_equals", ["actor.lr"], "bad override 'actor.lr'"),
    ("unknown_option", ["--verbose"], "unknown option '--verbose'"),
    ("cfg_hydra", ["--cfg", "hydra"], "only --cfg job"),
    # one bad value per range-checked key
    ("model.dtype", ["model.dtype=auto"], "model.dtype=auto: must be float32"),
    ("model.compute_dtype", ["model.compute_dtype=fp8"], "model.compute_dtype=fp8: must be auto"),
    ("data.prompt_key", ["data.prompt_key=''"], "data.prompt_key='': must be a non-empty string"),
    ("data.answer_key", ["data.answer_key=''"], "data.answer_key="),
    ("data.messages_key", ["data.messages_key=''"], "data.messages_key="),
    ("data.answer_extract", ["data.answer_extract=last"], "data.answer_extract=last: must be one of none, gsm8k_hash, boxed"),
    ("data.apply_chat_template", ["data.apply_chat_template=yes"], "data.apply_chat_template=yes: must be one of"),
    ("data.num_generated", ["data.num_generated=0"], "data.num_generated=0: must be >= 1"),
    ("data.max_prompt_tokens", ["data.max_prompt_tokens=-5"], "data.max_prompt_tokens=-5"),
    ("env.max_turns", ["env.max_turns=0"], "env.max_turns=0"),
    ("env.openreward.api_key_env", ["env.openreward.api_key_env=''"], "env.openreward.api_key_env='': must be a non-empty string"),
    ("env.openreward.tool_parser", ["env.openreward.tool_parser=xml"],
     "env.openreward.tool_parser=xml: must be one of hermes, mistral, llama3_json"),
    ("openreward_env_key", ["env.openreward.envs={local/Calc: {wieght: 2}}"], "env.openreward.envs.local/Calc.wieght; did you mean weight?"),
    ("openreward_serve_class", ["env.openreward.serve=envs/tool_use.py", "env.openreward.envs={local/CalcArithmetc: {}}"],
     "serves no environment 'calcarithmetc'; did you mean CalcArithmetic?"),
    ("rollout.engine", ["rollout.engine=vllm"], "rollout.engine=vllm: must be one of native, sglang"),
    ("rollout.n", ["rollout.n=0"], "rollout.n=0: must be >= 1"),
    ("rollout.max_new_tokens", ["rollout.max_new_tokens=0"], "rollout.max_new_tokens=0: must be >= 1"),
    ("rollout.temperature", ["rollout.temperature=-0.5"], "rollout.temperature=-0.5: must be >= 0"),
    ("rollout.top_p", ["rollout.top_p=0"], "rollout.top_p=0.0: must be in (0, 1]"),
    ("rollout.top_k", ["rollout.top_k=-1"], "rollout.top_k=-1"),
    ("rollout.stop_strings", ["rollout.stop_strings=['']"], "rollout.stop_strings="),
    ("rollout.dtype", ["rollout.dtype=int8"], "rollout.dtype=int8"),
    ("rollout.kv_pool_tokens", ["rollout.kv_pool_tokens=-1"], "rollout.kv_pool_tokens=-1"),
    ("rollout.kv_memory", ["rollout.kv_memory=lots"], "rollout.kv_memory=lots: must be a size (64MB, 1.5GB, 512KB)"),
    ("rollout.kv_memory_and_pool_tokens", ["rollout.kv_memory=64", "rollout.kv_pool_tokens=100"],
     "rollout.kv_memory=64 and rollout.kv_pool_tokens=100 both size the KV pool; give one"),
    ("rollout.kv_memory_fraction_cpu", ["rollout.kv_memory=0.3", "parallel.device=cpu"],
     "rollout.kv_memory=0.3 is a fraction of the free device memory, which needs parallel.device=cuda"),
    ("rollout.kv_dtype", ["rollout.kv_dtype=int4"], "rollout.kv_dtype=int4: must be one of auto, bf16, fp16, fp32, int8, fp8"),
    ("rollout.kv_dtype_sglang", ["rollout.kv_dtype=int8", "rollout.engine=sglang"],
     "rollout.kv_dtype=int8 with rollout.engine=sglang: SGLang has no int8 KV cache"),
    ("rollout.admission", ["rollout.admission=greedy"], "rollout.admission=greedy: must be one of optimistic, reserve"),
    ("rollout.admission_sglang", ["rollout.admission=reserve", "rollout.engine=sglang"],
     "rollout.admission=reserve with rollout.engine=sglang: worst-case reservation is the native engine's"),
    ("rollout.max_num_seqs", ["rollout.max_num_seqs=0"], "rollout.max_num_seqs=0"),
    ("rollout.max_batch_tokens", ["rollout.max_batch_tokens=0"], "rollout.max_batch_tokens=0"),
    ("rollout.quantization", ["rollout.quantization=int4"], "rollout.quantization=int4: must be one of none, int8, w8a8, fp8"),
    ("rollout.quantization_cpu", ["rollout.quantization=w8a8", "parallel.device=cpu"],
     "rollout.quantization=w8a8 is not supported with parallel.device=cpu"),
    ("rollout.decode_cache", ["rollout.decode_cache=yes"], "rollout.decode_cache=yes: must be one of auto, on, off"),
    ("rollout.cuda_graphs", ["rollout.cuda_graphs=maybe"], "rollout.cuda_graphs=maybe: must be one of auto, on, off"),
    ("rollout.prepack", ["rollout.prepack=yes"], "rollout.prepack=yes: must be one of auto, on, off, onednn, mkl"),
    ("rollout.prepack_bf16", ["rollout.prepack=on", "rollout.dtype=bfloat16"],
     "rollout.prepack=on with rollout.engine=native, parallel.device=auto, rollout.dtype=bfloat16, rollout.quantization=none: it packs float32 weights"),
    ("rollout.rescore_seqs", ["rollout.rescore_seqs=-1"], "rollout.rescore_seqs=-1: must be >= 0"),
    ("rollout.kv.algorithm", ["rollout.kv.algorithm=h2o"], "rollout.kv.algorithm=h2o: must be one of none, rkv, snapkv, streaming"),
    ("rollout.kv.budget", ["rollout.kv.budget=4"], "rollout.kv.budget=4 must be > rollout.kv.window=8"),
    ("rollout.kv.budget_zero", ["rollout.kv.budget=0"], "rollout.kv.budget=0: must be an integer >= 1 or auto"),
    ("rollout.kv.budget_word", ["rollout.kv.budget=half"], "rollout.kv.budget=half: must be an integer >= 1 or auto"),
    ("rollout.kv.budget_auto_dense", ["rollout.kv.budget=auto"], "rollout.kv.budget=auto with rollout.kv.algorithm=none"),
    ("rollout.kv.budget_auto_sglang", ["rollout.kv.algorithm=rkv", "rollout.kv.budget=auto", "rollout.engine=sglang"],
     "rollout.kv.budget=auto with rollout.engine=sglang"),
    ("rollout.kv.control.floor", ["rollout.kv.control.floor=0"], "rollout.kv.control.floor=0: must be >= 1"),
    ("rollout.kv.control.floor_window", ["rollout.kv.algorithm=rkv", "rollout.kv.budget=auto", "rollout.kv.control.floor=8"],
     "rollout.kv.control.floor=8 must be > rollout.kv.window=8"),
    ("rollout.kv.control.ceiling", ["rollout.kv.control.ceiling=-1"], "rollout.kv.control.ceiling=-1: must be >= 1"),
    ("rollout.kv.control.ordered", ["rollout.kv.control.floor=900", "rollout.kv.control.ceiling=800"],
     "rollout.kv.control.floor=900 must be <= rollout.kv.control.ceiling=800"),
    ("rollout.kv.control.target", ["rollout.kv.control.target=1.5"], "rollout.kv.control.target=1.5: must be in (0, 1]"),
    ("rollout.kv.control.hysteresis", ["rollout.kv.control.hysteresis=-0.1"], "rollout.kv.control.hysteresis=-0.1"),
    ("rollout.kv.control.factor", ["rollout.kv.control.factor=1"], "rollout.kv.control.factor=1.0: must be > 1"),
    ("rollout.kv.control.patience", ["rollout.kv.control.patience=0"], "rollout.kv.control.patience=0: must be >= 1"),
    ("rollout.kv.control.statistic", ["rollout.kv.control.statistic=xi_p10"],
     "rollout.kv.control.statistic=xi_p10: must be one of xi_p05, xi_p01"),
    ("rollout.kv.control.align", ["rollout.kv.control.align=0"], "rollout.kv.control.align=0: must be >= 1"),
    ("rollout.kv.divide_method", ["rollout.kv.divide_method=sentence"], "rollout.kv.divide_method=sentence"),
    ("rollout.kv.divide_length", ["rollout.kv.divide_length=0"], "rollout.kv.divide_length=0"),
    ("rollout.kv.window", ["rollout.kv.window=0"], "rollout.kv.window=0"),
    ("rollout.kv.mix_lambda", ["rollout.kv.mix_lambda=1.5"], "rollout.kv.mix_lambda=1.5: must be in [0, 1]"),
    ("rollout.kv.kernel", ["rollout.kv.kernel=4"], "rollout.kv.kernel=4: must be an odd integer"),
    ("rollout.kv.sim_threshold", ["rollout.kv.sim_threshold=2"], "rollout.kv.sim_threshold=2.0: must be in [-1, 1]"),
    ("rollout.kv.sinks", ["rollout.kv.sinks=-1"], "rollout.kv.sinks=-1"),
    ("rollout.kv.sinks_fit", ["rollout.kv.algorithm=streaming", "rollout.kv.budget=16", "rollout.kv.sinks=10"],
     "rollout.kv.sinks=10 must be <="),
    ("rollout.kv.share", ["rollout.kv.share=batch"], "rollout.kv.share=batch"),
    ("rollout.kv.variant", ["rollout.kv.variant=official"], "rollout.kv.variant=official: must be one of paper, reference"),
    ("rollout.sglang.mem_fraction_static", ["rollout.sglang.mem_fraction_static=1"],
     "rollout.sglang.mem_fraction_static=1.0: must be in (0, 1)"),
    ("rollout.sglang.chunked_prefill_size", ["rollout.sglang.chunked_prefill_size=-1"],
     "rollout.sglang.chunked_prefill_size=-1: must be >= 0"),
    ("rollout.sglang.weight_bucket_mb", ["rollout.sglang.weight_bucket_mb=0"], "rollout.sglang.weight_bucket_mb=0.0: must be > 0"),
    # keys folded into others: the one line names the key that replaced each
    ("renamed.sglang_dtype", ["rollout.sglang.dtype=bfloat16"],
     "rollout.sglang.dtype was folded into rollout.dtype (it sets both engines); use rollout.dtype=..."),
    ("renamed.sglang_release_weights", ["rollout.sglang.release_weights=false"],
     "rollout.sglang.release_weights was folded into rollout.release_weights (it sets both engines); "
     "use rollout.release_weights=..."),
    ("renamed.sglang_max_total_tokens", ["rollout.sglang.max_total_tokens=4096"],
     "rollout.sglang.max_total_tokens was folded into rollout.kv_pool_tokens (it sets both engines); "
     "use rollout.kv_pool_tokens=..."),
    ("renamed.sglang_max_running_requests", ["+rollout.sglang.max_running_requests=8"],
     "rollout.sglang.max_running_requests was folded into rollout.max_num_seqs (it sets both engines); "
     "use rollout.max_num_seqs=..."),
    ("actor.lr", ["actor.lr=-1"], "actor.lr=-1.0: must be >= 0"),
    ("actor.lr_nan", ["actor.lr=nan"], "actor.lr=nan: must be a finite number >= 0"),
    ("actor.weight_decay", ["actor.weight_decay=-0.1"], "actor.weight_decay=-0.1"),
    ("actor.betas", ["actor.betas=[0.9,1.5]"], "actor.betas=[0.9, 1.5]: must be 2 values, each in [0, 1)"),
    ("actor.betas_length", ["actor.betas=[0.9]"], "actor.betas=[0.9]"),
    ("actor.lr_schedule", ["actor.lr_schedule=linear"], "actor.lr_schedule=linear: must be one of constant, cosine"),
    ("actor.warmup_steps", ["actor.warmup_steps=-1"], "actor.warmup_steps=-1"),
    ("actor.min_lr_ratio", ["actor.min_lr_ratio=2"], "actor.min_lr_ratio=2.0"),
    ("actor.max_grad_norm", ["actor.max_grad_norm=0"], "actor.max_grad_norm=0.0: must be > 0"),
    ("actor.max_tokens_per_device", ["actor.max_tokens_per_device=0"], "actor.max_tokens_per_device=0"),
    ("actor.logprob_chunk_mb", ["actor.logprob_chunk_mb=-1"], "actor.logprob_chunk_mb=-1.0"),
    ("actor.updates_per_rollout", ["actor.updates_per_rollout=0"], "actor.updates_per_rollout=0"),
    ("actor.ppo_epochs", ["actor.ppo_epochs=0"], "actor.ppo_epochs=0"),
    ("actor.lora.rank", ["actor.lora.rank=-8"], "actor.lora.rank=-8: must be >= 0"),
    ("actor.lora.alpha", ["actor.lora.alpha=0"], "actor.lora.alpha=0.0: must be > 0"),
    ("actor.lora.dropout", ["actor.lora.dropout=1"], "actor.lora.dropout=1.0: must be in [0, 1)"),
    ("actor.lora.target_modules", ["actor.lora.target_modules=[]"], "actor.lora.target_modules=[]"),
    ("actor.lora.dropout_tp", ["actor.lora.rank=8", "actor.lora.dropout=0.1", "parallel.tp=2"],
     "actor.lora.dropout=0.1 with parallel.tp=2"),
    ("algo.adv_estimator", ["algo.adv_estimator=vtrace"],
     "algo.adv_estimator=vtrace: must be one of grpo, drgrpo, rloo, reinforce_pp, reinforce_pp_baseline"),
    ("algo.loss_agg", ["algo.loss_agg=batch"], "algo.loss_agg=batch: must be one of token, sequence"),
    ("algo.policy_loss", ["algo.policy_loss=ppoo"], "algo.policy_loss=ppoo"),
    ("algo.clip_low", ["algo.clip_low=1"], "algo.clip_low=1.0: must be in [0, 1)"),
    ("algo.clip_high", ["algo.clip_high=-0.2"], "algo.clip_high=-0.2"),
    ("algo.dual_clip", ["algo.dual_clip=0.5"], "algo.dual_clip=0.5: must be > 1, or null"),
    ("algo.dual_clip_cispo", ["algo.policy_loss=cispo", "algo.dual_clip=3"], "algo.dual_clip=3.0 is a PPO option"),
    ("algo.entropy_coef", ["algo.entropy_coef=-0.01"], "algo.entropy_coef=-0.01"),
    ("algo.kl.coef", ["algo.kl.coef=-1e-3"], "algo.kl.coef=-0.001: must be >= 0"),
    ("algo.kl.estimator", ["algo.kl.estimator=k4"], "algo.kl.estimator=k4"),
    ("algo.kl.mode", ["algo.kl.mode=both"], "algo.kl.mode=both: must be one of loss, reward"),
    ("algo.dynamic_sampling.max_rounds", ["algo.dynamic_sampling.max_rounds=0"],
     "algo.dynamic_sampling.max_rounds=0: must be >= 1"),
    ("algo.overlong.penalty", ["algo.overlong.penalty=-1"], "algo.overlong.penalty=-1.0: must be >= 0"),
    ("algo.overlong.buffer", ["algo.overlong.buffer=0"], "algo.overlong.buffer=0: must be >= 1"),
    ("algo.overlong.buffer_fits", ["algo.overlong.penalty=1", "algo.overlong.buffer=64", "rollout.max_new_tokens=48"],
     "algo.overlong.buffer=64 must be <= rollout.max_new_tokens=48"),
    ("algo.correction.mode", ["algo.correction.mode=log"], "algo.correction.mode=log: must be one of apply, measure"),
    ("algo.correction.is_cap", ["algo.correction.is_cap=-1"], "algo.correction.is_cap=-1.0"),
    ("algo.correction.normalize_over", ["algo.correction.normalize_over=batch"], "algo.correction.normalize_over=batch"),
    ("algo.correction.veto", ["algo.correction.veto=-1"], "algo.correction.veto=-1.0"),
    ("algo.correction.token_low", ["algo.correction.token_low=-0.5"], "algo.correction.token_low=-0.5"),
    ("algo.correction.token_high", ["algo.correction.token_high=-2"], "algo.correction.token_high=-2.0"),
    ("algo.correction.token_order", ["algo.correction.token_low=2", "algo.correction.token_high=1"],
     "algo.correction.token_low=2.0 must be <= algo.correction.token_high=1.0"),
    ("algo.correction.geo_low", ["algo.correction.geo_low=-1"], "algo.correction.geo_low=-1.0"),
    ("algo.correction.geo_high", ["algo.correction.geo_high=-1"], "algo.correction.geo_high=-1.0"),
    ("algo.correction.geo_order", ["algo.correction.geo_low=0.9", "algo.correction.geo_high=0.5"], "algo.correction.geo_low=0.9"),
    ("algo.correction.rescue", ["algo.correction.rescue=sparse"], "algo.correction.rescue=sparse: must be one of none, dense"),
    ("algo.correction.rescue_group_frac", ["algo.correction.rescue_group_frac=1.5"],
     "algo.correction.rescue_group_frac=1.5: must be in [0, 1]"),
    ("algo.correction.rescue_group_frac_off", ["+preset=sparse_rl", "algo.correction.rescue_group_frac=0.5"],
     "algo.correction.rescue_group_frac=0.5 re-rolls whole groups of the rescue, but algo.correction.rescue=none"),
    ("algo.correction.rescue_off", ["algo.correction.rescue=dense"],
     "algo.correction.rescue=dense re-rolls the sequences the correction rejects, but with algo.correction.enable=false"),
    ("algo.correction.rescue_sglang", ["+preset=sparse_rl", "algo.correction.rescue=dense", "rollout.engine=sglang"],
     "algo.correction.rescue=dense with rollout.engine=sglang"),
    ("parallel.tp", ["parallel.tp=0"], "parallel.tp=0"),
    ("parallel.cp", ["parallel.cp=0"], "parallel.cp=0"),
    ("parallel.cp_world", ["parallel.cp=2"], "parallel.cp=2 x parallel.tp=1 must divide the world size 1"),
    ("parallel.tp_world", ["parallel.tp=2"], "parallel.tp=2 must divide the world size 1"),
    ("parallel.cp_sglang", ["rollout.engine=sglang", "parallel.cp=2"], "parallel.cp=2 with rollout.engine=sglang"),
    ("parallel.backend", ["parallel.backend=mpi"], "parallel.backend=mpi: must be one of auto, gloo, nccl"),
    ("parallel.device", ["parallel.device=tpu"], "parallel.device=tpu: must be one of auto, cpu, cuda"),
    ("parallel.nccl_on_cpu", ["parallel.backend=nccl", "parallel.device=cpu"], "parallel.backend=nccl needs parallel.device=cuda"),
    ("rollout.kv.share_sglang_tp", ["+preset=sparse_rl", "rollout.engine=sglang", "parallel.tp=2"],
     "rollout.kv.share=layer with rollout.engine=sglang and parallel.tp=2"),
    ("trainer.total_steps", ["trainer.total_steps=0"], "trainer.total_steps=0"),
    ("trainer.prompts_per_step", ["trainer.prompts_per_step=0"], "trainer.prompts_per_step=0"),
    ("trainer.output_dir", ["trainer.output_dir=''"], "trainer.output_dir='': must be a non-empty string"),
    ("trainer.save_every", ["trainer.save_every=-1"], "trainer.save_every=-1"),
    ("trainer.resume", ["trainer.resume=''"], "trainer.resume='': must be none, auto or a checkpoint folder"),
    ("trainer.seed", ["trainer.seed=-1"], "trainer.seed=-1"),
    ("trainer.stop_after", ["trainer.stop_after=-1"], "trainer.stop_after=-1"),
    ("trainer.eval_every", ["trainer.eval_every=-1"], "trainer.eval_every=-1"),
    ("trainer.log_samples", ["trainer.log_samples=65"], "trainer.log_samples=65: must be in [0, 64]"),
    ("trainer.keep_last", ["trainer.keep_last=-1"], "trainer.keep_last=-1"),
    ("trainer.max_skipped_steps", ["trainer.max_skipped_steps=0"], "trainer.max_skipped_steps=0"),
    ("trainer.preempt_signals", ["trainer.preempt_signals=[SIGKILL]"], 'trainer.preempt_signals=["SIGKILL"]: must be a list, each one of SIGTERM'),
    ("env.step_timeout_s", ["env.step_timeout_s=-1"], "env.step_timeout_s=-1.0"),
    ("env.max_concurrency", ["env.max_concurrency=0"], "env.max_concurrency=0"),
    ("eval.n", ["eval.n=0"], "eval.n=0"),
    ("eval.k", ["eval.k=[0]"], "eval.k=[0]"),
    ("eval.temperature", ["eval.temperature=-1"], "eval.temperature=-1.0"),
    ("eval.top_p", ["eval.top_p=1.5"], "eval.top_p=1.5"),
    ("eval.max_new_tokens", ["eval.max_new_tokens=0"], "eval.max_new_tokens=0"),
    ("eval.limit", ["eval.limit=-1"], "eval.limit=-1"),
    ("eval.seed", ["eval.seed=-1"], "eval.seed=-1"),
    ("logger.wandb.mode", ["logger.wandb.mode=cloud"], "logger.wandb.mode=cloud: must be one of disabled, offline, online"),
    ("logger.wandb.project", ["logger.wandb.project=''"], "logger.wandb.project="),
    # the critic, the preference trainers and partial rollouts
    ("algo.gamma", ["algo.gamma=1.5"], "algo.gamma=1.5: must be in [0, 1]"),
    ("algo.lam", ["algo.lam=-1"], "algo.lam=-1.0: must be in [0, 1]"),
    ("critic.clip", ["critic.clip=0"], "critic.clip=0.0: must be > 0, or null (off)"),
    ("critic.lr", ["critic.lr=-1"], "critic.lr=-1.0: must be >= 0"),
    ("critic.lr_schedule", ["critic.lr_schedule=bogus"], "critic.lr_schedule=bogus: must be one of constant, cosine"),
    ("critic.max_grad_norm", ["critic.max_grad_norm=-1"], "critic.max_grad_norm=-1.0: must be > 0"),
    ("critic.warmup_steps", ["critic.warmup_steps=-1"], "critic.warmup_steps=-1: must be >= 0"),
    ("critic.weight_decay", ["critic.weight_decay=-1"], "critic.weight_decay=-1.0: must be >= 0"),
    ("dpo.beta", ["dpo.beta=-1"], "dpo.beta=-1.0: must be > 0"),
    ("dpo.eval_every", ["dpo.eval_every=-1"], "dpo.eval_every=-1: must be >= 0"),
    ("dpo.eval_limit", ["dpo.eval_limit=-1"], "dpo.eval_limit=-1: must be >= 0"),
    ("dpo.loss", ["dpo.loss=bogus"], "dpo.loss=bogus: must be one of sigmoid, ipo"),
    ("dpo.max_length", ["dpo.max_length=0"], "dpo.max_length=0: must be >= 1"),
    ("rm.eval_every", ["rm.eval_every=-1"], "rm.eval_every=-1: must be >= 0"),
    ("rm.eval_limit", ["rm.eval_limit=-1"], "rm.eval_limit=-1: must be >= 0"),
    ("rm.max_length", ["rm.max_length=0"], "rm.max_length=0: must be >= 1"),
    ("rollout.partial.finish_frac", ["rollout.partial.finish_frac=2"], "rollout.partial.finish_frac=2.0: must be in (0, 1]"),
    ("rollout.partial.max_staleness", ["rollout.partial.max_staleness=-1"], "rollout.partial.max_staleness=-1: must be >= 0"),
    ("rollout.partial.max_tokens", ["rollout.partial.max_tokens=-1"], "rollout.partial.max_tokens=-1: must be >= 0"),
    ("parallel.dp_replicate", ["parallel.dp_replicate=0"], "parallel.dp_replicate=0: must be >= 1"),
    ("env.reward_model.mode", ["env.reward_model.mode=mul"], "env.reward_model.mode=mul: must be one of replace, add"),
    ("env.reward_model.coef", ["env.reward_model.coef=0"], "env.reward_model.coef=0.0: must be > 0"),
]
OK_CASES = {  # exit 0: (overrides, what stdout must contain)
    "help": (["--help"], "actor.lr = 5e-06"),
    "help_short": (["-h", "+preset=sparse_rl"], "rollout.kv.algorithm = rkv"),
    "cfg_job": (["--cfg", "job", "+preset=sparse_rl", "actor.lr=3e-4"], "lr: 0.0003"),
}


def write_data(folder: Path) -> None:
    rows = lambda *rs: "".join(json.dumps(r) + "\n" for r in rs)  # noqa: E731
    files = {
        "empty.jsonl": "",
        "blank.jsonl": "\n  \n\n",
        "ok.jsonl": rows({"prompt": "1 + 1?", "answer": "2"}),
        "bad_json.jsonl": rows({"prompt": "hi", "answer": "1"}) + '{"prompt": "hi"\n',
        "array_line.jsonl": '["prompt", "answer"]\n',
        "broken.json": '[{"prompt": "a", "answer": 1},\n {"prompt": "b" "answer": 2}]\n',
        "prompt_int.jsonl": rows({"prompt": "ok", "answer": "1"}, {"prompt": 5, "answer": "2"}),
        "no_prompt.jsonl": rows({"question": "no prompt", "answer": "1"}),
        "answer_dict.jsonl": rows({"prompt": "hi", "answer": {"value": 1}}),
        "no_answer.jsonl": rows({"prompt": "a", "answer": "1"}, {"prompt": "b"}),
        "bad_messages.jsonl": rows({"prompt": [{"role": "user", "content": 7}], "answer": "7"}),
        "system.jsonl": rows({"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"},
                             {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
                              "answer": "4"}),
        "extra.csv": "prompt,answer\n1 + 1?,2\n2 + 2?,4,extra\n",
        "open_quote.csv": 'prompt,answer\n"1 + 1?,2\n2 + 2?,4\n',
        "question.csv": "question,answer\n1 + 1?,2\n",
        "notes.txt": "some notes\n",
    }
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "binary.jsonl").write_bytes(bytes(range(128, 256)) * 4)
    (folder / "latin1.jsonl").write_bytes(rows({"prompt": "a", "answer": "1"}).encode() + b'{"prompt": "caf\xe9", "answer": "2"}\n')
    (folder / "nul.jsonl").write_bytes(b'{"prompt": "a\x00", "answer": "1"}\n')
    (folder / "fake.parquet").write_bytes(b"this is not parquet at all")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [1, 2], "answer": ["1", "2"]}), folder / "prompt_int.parquet")


def rejecting_checkpoint(folder: Path) -> Path:
    """A two-word tokenizer whose chat template rejects system messages, and a config without weights: the
    error must come before any model is loaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    ckpt = folder / "rejecting-template"
    ckpt.mkdir()
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
                                                            "unk_token": "<unk>", "chat_template": REJECTING_TEMPLATE}))
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return ckpt


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "SPARSERL_PROGRESS": "0",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("RANK", None)
    return subprocess.run(command(1, "-m", "sparserl.trainer.grpo", *args), env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's (process, output folder), run WORKERS at a time."""
    root = tmp_path_factory.mktemp("bad_inputs")
    data = root / "data"
    data.mkdir()
    write_data(data)
    ckpt = rejecting_checkpoint(root)
    fill = lambda a: a.replace("{data}", str(data)).replace("{ckpt}", str(ckpt))  # noqa: E731 - overrides may hold braces
    jobs = {}
    for case_id, overrides, _ in CASES:
        out = root / "out" / case_id
        jobs[case_id] = ([f"trainer.output_dir={out}"] + [fill(a) for a in overrides], out)
    for case_id, (overrides, _) in OK_CASES.items():
        out = root / "out" / case_id
        jobs[case_id] = ([f"trainer.output_dir={out}"] + overrides, out)
    with ThreadPoolExecutor(WORKERS) as pool:
        futures = {k: pool.submit(run_cli, jobs[k][0], root) for k in sorted(jobs, key=lambda k: k not in SLOW)}
        done = {k: (f.result(), jobs[k][1]) for k, f in futures.items()}
    return done, fill


@pytest.mark.parametrize("case_id, expect", [(c[0], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_nothing_written(results, case_id, expect):
    done, fill = results
    res, out = done[case_id]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(errors) == 1 and fill(expect) in errors[0], res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert not out.exists()


def test_help_lists_every_key_with_value_and_description(results):
    done, _ = results
    for case_id in ("help", "help_short"):
        res, out = done[case_id]
        assert res.returncode == 0 and not res.stderr.strip() and not out.exists(), res.stderr[-3000:]
        assert OK_CASES[case_id][1] in res.stdout
    text = done["help"][0].stdout
    line = next(line for line in text.splitlines() if line.strip().startswith("actor.lr ="))
    assert "5e-06" in line and "AdamW learning rate" in line and "[>= 0]" in line
    for key in list(RULES) + list(FREE):
        assert f"  {key} = " in text, key
    assert "usage: python -m sparserl.trainer.grpo" in text and "--cfg job" in text


def test_cfg_job_prints_the_resolved_config(results):
    res, out = results[0]["cfg_job"]
    assert res.returncode == 0 and not out.exists(), res.stderr[-3000:]
    cfg = yaml.safe_load(res.stdout)
    assert cfg["actor"]["lr"] == 3e-4 and cfg["rollout"]["kv"]["algorithm"] == "rkv"  # the override and the preset
    assert cfg["trainer"]["output_dir"] == str(out)


def test_every_key_has_a_rule_or_is_free_and_every_rule_a_case():
    keys = set(leaf_keys())
    assert not set(RULES) - keys, "rules for keys the schema does not have"
    assert not set(RANGES) - keys, "hand-written rules for keys the schema does not have"
    assert not set(FREE) & set(RULES)
    assert keys == set(RULES) | set(FREE), f"keys without a rule: {sorted(keys - set(RULES) - set(FREE))}"
    tested = {c[0] for c in CASES} | {a.split("=")[0] for c in CASES for a in c[1]}
    assert not set(RULES) - tested, f"rules without a case: {sorted(set(RULES) - tested)}"
    assert set(RENAMED) <= {a.split("=")[0].lstrip("+") for c in CASES for a in c[1]}, "renamed keys without a case"
    assert not set(RENAMED) & keys and set(new for new, _ in RENAMED.values()) <= keys

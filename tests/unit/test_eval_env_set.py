"""Evaluation on the task a run trains on (`eval.datasets=[env]`: the env's own make_prompts with a held-out seed,
sparserl/eval/datasets.py), and `eval.n > 1` at temperature 0 refused (greedy samples are all the same)."""
import importlib.util

import pytest

from sparserl.config import EvalConfig
from sparserl.config.load import load_config
from sparserl.eval.datasets import held_out_seed, load_eval_sets
from sparserl.utils.errors import UserError

ARITHMETIC = "envs/arithmetic.py"


def _arithmetic():
    spec = importlib.util.spec_from_file_location("arithmetic_env", ARITHMETIC)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_env_set_asks_the_training_env_with_a_held_out_seed():
    (s,) = load_eval_sets(EvalConfig(datasets=["env"], limit=64), ARITHMETIC)
    assert s.name == "env" and len(s.rows) == 64 and s.env.path.endswith(ARITHMETIC)
    made = _arithmetic().make_prompts(64, held_out_seed(0))
    assert [r.answer for r in s.rows] == [m["answer"] for m in made]
    assert [r.prompt for r in s.rows] == [m["prompt"] for m in made]
    training = _arithmetic().make_prompts(64, 0)  # trainer.seed=0: the default run's rows
    assert [r.prompt for r in s.rows] != [m["prompt"] for m in training]
    assert held_out_seed(0) > 10**6 and held_out_seed(1) != held_out_seed(0)
    (default,) = load_eval_sets(EvalConfig(datasets=["env"]), ARITHMETIC)
    assert len(default.rows) == 256  # eval.limit=0: GENERATED rows
    (mine,) = load_eval_sets(EvalConfig(datasets=[{"name": "chains", "env": "envs/long_chain.py", "generate": 5}]))
    assert mine.name == "chains" and len(mine.rows) == 5 and mine.env.path.endswith("envs/long_chain.py")


def test_an_env_without_make_prompts_is_one_line():
    with pytest.raises(UserError, match=r"eval.datasets\[0\] \(env\): envs/math.py has no make_prompts"):
        load_eval_sets(EvalConfig(datasets=["env"]), "envs/math.py")
    with pytest.raises(UserError, match="name one of gsm8k, .*, env"):
        load_eval_sets(EvalConfig(datasets=["envs"]), ARITHMETIC)


def test_several_greedy_samples_per_prompt_are_refused():
    with pytest.raises(UserError) as e:
        load_config(["eval.n=4", "eval.k=[1,4]"], config_name="eval")
    assert str(e.value) == ("eval.n=4 at eval.temperature=0: greedy decoding draws the same response 4 times, so "
                            "pass@k would be pass@1; set eval.temperature > 0 (e.g. eval.temperature=0.6 "
                            "eval.top_p=0.95) for pass@k, or eval.n=1")
    assert load_config(["eval.n=4", "eval.k=[1,4]", "eval.temperature=0.6"], config_name="eval").eval.n == 4

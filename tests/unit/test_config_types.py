"""A value of the wrong type on the command line names the type its key wants, with the key's default as an
example, instead of Hydra's "Error merging override ..." (sparserl/config/load.py)."""
import pytest

from sparserl.config.load import load_config
from sparserl.utils.errors import UserError

CASES = [
    ("trainer.total_steps=abc", "trainer.total_steps=abc: trainer.total_steps wants an integer, e.g. trainer.total_steps=15"),
    ("trainer.total_steps=1.5", "trainer.total_steps=1.5: trainer.total_steps wants an integer, e.g. trainer.total_steps=15"),
    ("actor.lr=abc", "actor.lr=abc: actor.lr wants a number, e.g. actor.lr=5e-06"),
    ("trainer.export_hf=maybe", "trainer.export_hf=maybe: trainer.export_hf wants true or false, e.g. trainer.export_hf=true"),
    ("actor.betas=[a,b]", "actor.betas=[a,b]: actor.betas wants a list of numbers, e.g. actor.betas=[0.9,0.999]"),
    ("eval.k=x", "eval.k=x: eval.k wants a list of integers, e.g. eval.k=[1]"),
    ("rollout.stop_strings=5", "rollout.stop_strings=5: rollout.stop_strings wants a list of strings, e.g. rollout.stop_strings=[a,b]"),
    ("logger.wandb.name=[1]", "logger.wandb.name=[1]: logger.wandb.name wants a string or null, e.g. logger.wandb.name=null"),
]


@pytest.mark.parametrize("override, line", CASES, ids=[c[0].split("=")[0] for c in CASES])
def test_a_wrong_type_names_the_type_the_key_wants(override, line):
    with pytest.raises(UserError) as e:
        load_config([override])
    assert str(e.value) == line

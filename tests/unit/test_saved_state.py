"""The registry of saved trainer state (sparserl/trainer/saved_state.py): save and load walk the same pieces, what is
saved reads back through `torch.load(weights_only=True)` into fresh pieces, and an older checkpoint's missing keys
take the piece's default, keep its fresh state, or refuse the checkpoint."""
import pytest
import torch

from sparserl.config import Config
from sparserl.data.prompt_sampler import PromptSampler
from sparserl.kv.budget_control import BudgetControlConfig, BudgetController
from sparserl.trainer import resume
from sparserl.trainer.saved_state import SavedState, keep
from sparserl.utils.errors import UserError


class Run:
    """The stateful pieces of a run, real ones: an LR schedule, a prompt sampler, a KV budget controller, a step."""

    def __init__(self) -> None:
        self.step, self.world = 0, 2
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (k + 1))
        self.sampler = PromptSampler(10, 4, 0, 1, seed=3, shuffle=True)
        self.budget = BudgetController(BudgetControlConfig(floor=8, ceiling=64, target=0.5, patience=1, align=4))
        self.consecutive_skips = 0

    def registry(self) -> SavedState:
        saved = SavedState()
        saved.register("step", lambda: self.step, lambda v: setattr(self, "step", int(v)))
        saved.add("scheduler", self.scheduler)
        saved.add("sampler", self.sampler)
        saved.register("kv_budget", self.budget.state_dict, self.budget.load_state_dict, optional=True)
        saved.register("world_size", lambda: self.world, lambda v: setattr(self, "world", int(v)), default=1)
        resume.register(saved, Config(), self)
        return saved

    def advance(self, steps: int) -> None:
        for _ in range(steps):
            self.step += 1
            self.scheduler.optimizer.step()
            self.scheduler.step()
            self.sampler.next()
            self.budget.update(0.9)
        self.consecutive_skips = 2


def test_what_is_saved_loads_back_into_fresh_pieces(tmp_path):
    run = Run()
    run.advance(3)
    torch.save(run.registry().state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert list(state) == ["step", "scheduler", "sampler", "kv_budget", "world_size", "settings", "consecutive_skips"]

    fresh = Run()
    fresh.registry().load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert fresh.step == 3 and fresh.consecutive_skips == 2 and fresh.budget.budget == run.budget.budget
    assert fresh.scheduler.get_last_lr() == run.scheduler.get_last_lr() != [1.0]
    assert fresh.sampler.next().global_indices == run.sampler.next().global_indices


def test_an_older_checkpoint_takes_defaults_or_keeps_fresh_state():
    """A checkpoint from before the budget controller, the resume record and world_size: those pieces keep their
    fresh state or take their default; the pieces every checkpoint has are loaded."""
    old, fresh = Run(), Run()
    old.advance(2)
    state = {"step": 2, "scheduler": old.scheduler.state_dict(), "sampler": old.sampler.state_dict()}
    fresh.consecutive_skips = 7
    fresh.registry().load_state_dict(state)
    assert fresh.step == 2 and fresh.world == 1 and fresh.consecutive_skips == 0
    assert fresh.budget.budget == Run().budget.budget  # not in the checkpoint: the controller starts fresh
    assert fresh.sampler.next().global_indices == old.sampler.next().global_indices


def test_a_missing_required_piece_refuses_the_checkpoint():
    run = Run()
    state = run.registry().state_dict()
    del state["sampler"]
    with pytest.raises(UserError, match="trainer.resume=ckpt: its trainer state has no 'sampler'"):
        Run().registry().load_state_dict(state, "ckpt")


def test_a_key_is_registered_once():
    saved = SavedState()
    saved.register("tp", lambda: 1, keep)
    with pytest.raises(AssertionError, match="registered twice"):
        saved.register("tp", lambda: 2, keep)

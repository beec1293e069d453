"""The registry of what a checkpoint's `trainer_state.pt` holds besides the model and optimizer shards.

Each stateful piece of the run is registered once, under its key, with a pair: `save()` returns its plain state
(numbers, strings, lists, dicts, tensors: what `torch.load(weights_only=True)` reads back), `load(value)` puts a
saved value back. `state_dict()` walks the registry to build the saved dict and `load_state_dict()` walks it to
restore one, so a piece that is saved is also restored, and the other way round: a new piece cannot be forgotten
by one of them. The keys are the checkpoint's (`Trainer` registers them in the order earlier checkpoints wrote
them), so a checkpoint written before the registry resumes as it did.

A key absent from an older checkpoint: `default` is loaded in its place when the piece gives one, and otherwise the
piece keeps its fresh state (`optional=True`) or the checkpoint is refused (a UserError naming the key).
Left out on purpose: versioning the trainer state (a new piece gives a default or is optional instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sparserl.utils.errors import UserError

_NONE = object()


def keep(value: Any) -> None:
    """The `load` of a piece only recorded for the reader (or checked before anything is built)."""


@dataclass(frozen=True)
class Piece:
    key: str
    save: Callable[[], Any]
    load: Callable[[Any], None]
    default: Any = _NONE
    optional: bool = False


class SavedState:
    def __init__(self) -> None:
        self._pieces: dict[str, Piece] = {}

    def register(self, key: str, save: Callable[[], Any], load: Callable[[Any], None], *, default: Any = _NONE,
                 optional: bool = False) -> None:
        assert key not in self._pieces, f"trainer state {key!r} is registered twice"
        self._pieces[key] = Piece(key, save, load, default, optional)

    def add(self, key: str, obj: Any, *, optional: bool = False) -> None:
        """A piece with its own `state_dict` / `load_state_dict` (a scheduler, a sampler, a controller)."""
        self.register(key, obj.state_dict, obj.load_state_dict, optional=optional)

    @property
    def keys(self) -> list[str]:
        return list(self._pieces)

    def state_dict(self) -> dict[str, Any]:
        return {key: piece.save() for key, piece in self._pieces.items()}

    def load_state_dict(self, state: dict[str, Any], path: Path | str = "the checkpoint") -> None:
        for key, piece in self._pieces.items():
            if key in state:
                piece.load(state[key])
            elif piece.default is not _NONE:
                piece.load(piece.default)
            elif not piece.optional:
                raise UserError(f"trainer.resume={path}: its trainer state has no {key!r}; it was not written by "
                                "this trainer (or is damaged): start a new run")

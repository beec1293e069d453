"""Which folder a run writes to, in-process (trainer/run_dir.py, utils/runs.py, trainer/preflight.py `check_output`):
with the default `trainer.output_dir=auto` each run gets a new folder and `latest` moves to it, `trainer.resume=auto`
continues the newest, a named folder holding a run is refused unless resuming or overwriting, and a checkpoint of
another run is refused on resume. tests/e2e/test_run_folders.py runs the same through the trainer on two ranks."""
import json
import os

import pytest

from sparserl.config.load import load_config
from sparserl.trainer.preflight import check_output
from sparserl.trainer.run_dir import GRPO_ROOT, check_run_id, resolve_output, run_id
from sparserl.utils import runs
from sparserl.utils.errors import UserError


@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def fake_run(folder, steps=2, checkpoint=2, run="run-a"):
    """What a run leaves: metrics rows, a complete checkpoint, run.json."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n"
                                                  for s in range(1, steps + 1)))
    (folder / "config.yaml").write_text("trainer: {}\n")
    if checkpoint:
        ckpt = folder / "checkpoints" / f"step_{checkpoint:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / "COMPLETE").write_text(str(checkpoint))
    runs.write_run_file(folder, run)
    return folder


def resolved(*overrides) -> str:
    cfg = load_config(list(overrides))
    resolve_output(cfg, rank=0, world_size=1, root=GRPO_ROOT)
    return cfg.trainer.output_dir


def test_each_default_run_gets_its_own_folder_and_resume_auto_the_newest(here):
    first, second = resolved(), resolved()  # the same second: the second gets a -2 suffix
    root = here / GRPO_ROOT
    assert first != second and {first, second} == {f"{GRPO_ROOT}/{p.name}" for p in root.iterdir() if p.name != "latest"}
    assert str(runs.latest_run(GRPO_ROOT)) == second and os.readlink(root / "latest") == os.path.basename(second)
    assert str(runs.follow_latest(GRPO_ROOT)) == second
    assert resolved("trainer.resume=auto") == second  # continues the newest run: no new folder
    ckpt = fake_run(here / first) / "checkpoints" / "step_000002"
    assert resolved(f"trainer.resume={ckpt}") == str(here / first)  # a checkpoint's own run folder
    assert len(list(root.iterdir())) == 3
    named = here / "mine"
    assert resolved(f"trainer.output_dir={named}") == str(named) and not named.exists()  # made when the run writes


def test_a_named_folder_with_a_run_is_refused_unless_resuming_or_overwriting(here):
    folder = fake_run(here / "run", steps=3, checkpoint=2)
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(UserError) as e:
        check_output(load_config([f"trainer.output_dir={folder}"]))
    assert str(e.value) == (f"trainer.output_dir={folder} holds a run already (metrics up to step 3, a checkpoint of "
                            "step 2); continue it with trainer.resume=auto, start over with trainer.overwrite=true, or "
                            "leave trainer.output_dir unset for a new folder under outputs/grpo/")
    check_output(load_config([f"trainer.output_dir={folder}", "trainer.resume=auto"]))
    check_output(load_config([f"trainer.output_dir={here / 'fresh'}"]))
    (here / "attempt").mkdir()
    (here / "attempt" / "config.yaml").write_text("{}")  # a run that stopped before its first step holds no run
    check_output(load_config([f"trainer.output_dir={here / 'attempt'}"]))
    with pytest.raises(UserError, match="trainer.overwrite=true starts the run over, but trainer.resume=auto"):
        load_config([f"trainer.output_dir={folder}", "trainer.overwrite=true", "trainer.resume=auto"])
    cfg = load_config([f"trainer.output_dir={folder}", "trainer.overwrite=true"])
    check_output(cfg)
    resolve_output(cfg, rank=0, world_size=1, root=GRPO_ROOT)  # rank 0 removes the old run's files, nothing else
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_a_checkpoint_of_another_run_is_refused_on_resume(here):
    folder = fake_run(here / "run", run="run-b")
    cfg = load_config([f"trainer.output_dir={folder}", "trainer.resume=auto"])
    check_run_id(cfg, {"run_id": "run-b"}, "ckpt")
    check_run_id(cfg, {}, "ckpt")  # a checkpoint from before run ids: unchecked
    with pytest.raises(UserError) as e:
        check_run_id(cfg, {"run_id": "run-a"}, "ckpt")
    assert str(e.value).startswith(f"trainer.resume=ckpt: the checkpoint is of run run-a, but trainer.output_dir={folder} "
                                   "holds run run-b")
    assert run_id(cfg, "run-b") == "run-b" and run_id(cfg, None) == "run-b"  # a resume keeps the run's id
    fresh = run_id(load_config([f"trainer.output_dir={here / 'other'}"]), None)
    assert fresh not in ("run-a", "run-b") and fresh != run_id(load_config([]), None)


def test_latest_as_a_file_holding_the_name(here):
    """Where a filesystem has no symbolic links, `latest` is a file holding the folder's name."""
    root = here / "outputs" / "sft"
    folder = runs.new_run_folder(root)
    (root / "latest").write_text(folder.name + "\n")
    assert runs.latest_run(root) == folder and runs.follow_latest(root) == folder
    runs.point_latest(root, runs.new_run_folder(root))  # replaced by a link in one rename
    assert (root / "latest").is_symlink() and runs.latest_run(root) != folder

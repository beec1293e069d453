"""From the run's config to the pieces both entry points start (training and `python -m sparserl.eval`): the
rollout engine built from its own options (`engines.py`) and the `auto` precision resolved for this hardware
(`precision.py`). The one place where `Config` meets the engines: engines never see `Config`, and the evaluation
does not import the trainer."""

"""From the run's config to the rollout engine both entry points start (training and `python -m sparserl.eval`):
`rollout.*` mapped onto the engine's own options and the engine built (`build.py`), and what the chosen engine
needs of this machine checked up front (`checks.py`). The one place where `Config` meets the engines: engines
never see `Config`, and the evaluation does not import the trainer."""

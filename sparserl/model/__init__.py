"""What the actor and the rollout engines both run: packed attention over a forward context (`attention.py`) and
the sampling transform (`sampling.py`). It imports neither side, so neither side imports the other."""

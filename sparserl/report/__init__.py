"""`python -m sparserl.report RUN_DIR`: one self-contained HTML page about a training run.

The page holds the run's curves (reward, length, sparse/dense mismatch, correction, KV, time; drawn by matplotlib
from `metrics.jsonl`, sparserl/report/curves.py) and a sample viewer over `samples/step_N.jsonl`
(`trainer.log_samples`, sparserl/trainer/samples.py): a step selector and, for each logged sequence, its response
tokens coloured by log xi = logp_old - logp_sparse, the KV compression points, masked and veto tokens, rejected
sequences flagged, per-token numbers on hover. Everything is inlined (sparserl/report/page.py), so the file opens
offline and can be mailed or attached.

Needs matplotlib (in the base install). Left out on purpose: comparing runs on one page
(scripts/plot_metrics.py overlays runs), a live view of a running job (re-run the command), and eval samples
(sparserl.eval writes its own samples.jsonl).
"""
from sparserl.report.page import build_report

__all__ = ["build_report"]

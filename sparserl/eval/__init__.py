"""Evaluation: `python -m sparserl.eval` (__main__.py) and evaluation during training (hook.py).

A regular package, so that wheels built with setuptools' `find_packages` include it.
"""

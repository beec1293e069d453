"""Answer checking for rewards (math-verify under a hard time limit) and small answer extractors."""
from sparserl.rewards.math import CheckPool, averify_answer, extract_boxed, extract_last_integer, verify_answer

__all__ = ["CheckPool", "averify_answer", "extract_boxed", "extract_last_integer", "verify_answer"]

"""Prompt data: loading rows from local files, formatting prompts, and choosing each step's prompts."""
from sparserl.data.dataset import ANSWER_EXTRACTORS, PromptRow, format_prompt, load_prompts, rows_from_records
from sparserl.data.prompt_sampler import PromptSampler, StepBatch

__all__ = ["ANSWER_EXTRACTORS", "PromptRow", "PromptSampler", "StepBatch", "format_prompt", "load_prompts", "rows_from_records"]

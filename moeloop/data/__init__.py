"""Prompt datasets: JSONL / parquet files and the built-in synthetic arithmetic task, a resumable
deterministic cursor over them, and tokenization through the model's chat template."""
from moeloop.data.cursor import EpochCursor
from moeloop.data.dataset import PromptDataset, load_rows
from moeloop.data.synthetic import ArithTask

__all__ = ["ArithTask", "EpochCursor", "PromptDataset", "load_rows"]

"""Per-client metrics, their summaries, and report tables."""

from privfl.evaluation.metrics import ClientScore, mean_sem, score_model, summarize_scores
from privfl.evaluation.report import comparison_table

__all__ = ["ClientScore", "mean_sem", "score_model", "summarize_scores", "comparison_table"]

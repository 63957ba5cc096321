"""Reports over finished runs: comparison tables, plots, the novel-client pool and the reference results.

The per-client scores themselves are :mod:`privfl.metrics`, a low layer that the runtimes and methods use.
"""

from privfl.evaluation.report import comparison_table

__all__ = ["comparison_table"]

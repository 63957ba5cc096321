"""Where a run's time goes: wall and CPU seconds of its rounds, split into client work, aggregation, evaluation and
bookkeeping, for the ``time`` field of each ``metrics.jsonl`` line.

A :class:`RoundTimer` times one period: the rounds between two lines of ``metrics.jsonl`` (``eval_every`` rounds,
one with ``--eval-every 1``). :meth:`Runtime.run_round <privfl.federation.runtime.Runtime.run_round>` times its
exchanges (:data:`CLIENT`: the messages down, the clients' work, the releases up and their ledger records; on Flower
the round trip to the nodes, with SecAgg+ where a secure sum is asked for) and the strategy's aggregation
(:data:`AGGREGATION`); :func:`privfl.experiment.train` times the evaluation of the period's last round
(:data:`EVALUATION`: the training clients' validation scores and the central evaluation) and closes the period with
:meth:`RoundTimer.lap`. Bookkeeping is the rest of the period: sampling, configuring messages, the server's releases
for every client, committing client states, checkpoints, the progress bar.

Wall seconds come from :func:`time.perf_counter`, CPU seconds from :func:`time.process_time`: the CPU of this
process, all its threads (so CPU seconds may exceed wall seconds), never that of worker processes or Flower nodes,
whose client work shows here as wall time only. Timing is measured, not reproduced: two runs of one config agree on
every field of ``metrics.jsonl`` but ``time`` (:func:`without_timing`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

#: The timed parts of a round; bookkeeping is what the period spent outside them.
CLIENT, AGGREGATION, EVALUATION = "client", "aggregation", "evaluation"
PARTS = (CLIENT, AGGREGATION, EVALUATION)
#: The key of a ``metrics.jsonl`` line that holds its timing.
TIMING_KEY = "time"


class RoundTimer:
    """Wall and CPU seconds of a period of rounds, whole and by part (:data:`PARTS`); parts never nest (a part
    entered inside another is counted in the outer one only), so they sum to no more than the whole.

    >>> timer = RoundTimer()
    >>> with timer.part(CLIENT):
    ...     pass
    >>> fields = timer.lap(rounds=1)
    >>> fields["rounds"], fields["client_wall_s"] <= fields["wall_s"]
    (1, True)
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start a new period now (a run's first round, or a resumed run's)."""
        self._start = (time.perf_counter(), time.process_time())
        self._parts = {name: [0.0, 0.0] for name in PARTS}
        self._inside = False

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Count the seconds of the ``with`` block toward part ``name``."""
        if name not in self._parts:
            raise ValueError(f"no timed part {name!r}; parts: {', '.join(PARTS)}")
        if self._inside:
            yield
            return
        self._inside = True
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._parts[name][0] += time.perf_counter() - wall
            self._parts[name][1] += time.process_time() - cpu
            self._inside = False

    def lap(self, *, rounds: int) -> dict[str, Any]:
        """The period's seconds as the ``time`` field of a metrics line (``rounds``: how many rounds it ran), then
        start the next period. ``wall_s`` and ``cpu_s`` are the whole; ``<part>_wall_s`` and ``<part>_cpu_s`` each
        part, bookkeeping being the whole less the timed parts."""
        wall = time.perf_counter() - self._start[0]
        cpu = time.process_time() - self._start[1]
        fields: dict[str, Any] = {"rounds": rounds, "wall_s": wall, "cpu_s": cpu}
        for name, (part_wall, part_cpu) in self._parts.items():
            fields[f"{name}_wall_s"], fields[f"{name}_cpu_s"] = part_wall, part_cpu
        fields["bookkeeping_wall_s"] = max(0.0, wall - sum(w for w, _ in self._parts.values()))
        fields["bookkeeping_cpu_s"] = max(0.0, cpu - sum(c for _, c in self._parts.values()))
        self.reset()
        return fields


def without_timing(records: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``metrics.jsonl`` records without their :data:`TIMING_KEY` field: what two runs of one config (another
    engine, more workers, interrupted and resumed) must agree on exactly."""
    return [{k: v for k, v in record.items() if k != TIMING_KEY} for record in records]

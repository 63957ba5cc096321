"""What a client procedure knows besides its data and the message."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

ClientState = dict[str, torch.Tensor]
"""What a client keeps between rounds (control variates, a personal model, ...): tensors only, so it checkpoints.

Procedures replace entries (``state[k] = new``) rather than modifying tensors in place, so the runtime can keep the
state of the last completed round by reference.
"""


@dataclass(frozen=True)
class ClientContext:
    """Who the client is, the round, and its random stream.

    ``rng`` is a numpy generator keyed by (run seed, round, client), for minibatch order and any other draw, so a
    resumed run and a run on another engine draw the same numbers.
    """

    client_id: int
    round: int
    run_seed: int
    rng: np.random.Generator

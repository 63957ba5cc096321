"""What a client procedure knows besides its data and the message."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from privfl.federation.seeding import derive_rng, derive_seed

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


def client_context(seed: int, client_id: int, round: int, stage: int = 0) -> ClientContext:
    """The client's context for (round, stage) of run ``seed``, with torch's CPU generator seeded for it.

    Every runtime (in-process, each Flower node) builds client contexts here, so a client computes the same numbers
    wherever it runs (invariant 7 of docs/invariants.md). Only the CPU generator is seeded: ``torch.manual_seed`` also
    seeds every
    accelerator backend lazily, capturing a stack trace each time (about 3 ms per client, 4% of a FedAvg round).
    CUDA's generators are seeded too once CUDA is in use (a run on device 'cuda', :mod:`privfl.devices`).
    """
    keys = (round, client_id) if stage == 0 else (round, client_id, stage)
    purpose = "client_train" if stage == 0 else "client_stage"
    torch_seed = derive_seed(seed, "torch" if stage == 0 else "torch_stage", *keys)
    torch.default_generator.manual_seed(torch_seed)
    # a run on CUDA: its generators too, so its draws there repeat (torch leaves is_initialized unannotated)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        torch.cuda.manual_seed_all(torch_seed)
    return ClientContext(client_id=client_id, round=round, run_seed=seed, rng=derive_rng(seed, purpose, *keys))

"""Local training: each training client trains its own model alone and sends nothing.

It is the reference point for personalisation: reported for training clients only (it has no model to give a novel
client, since a novel client has no labels). All clients start from the same initial weights (the run seed).
"""

from __future__ import annotations

from typing import Any

from privfl.data import TrainingClient
from privfl.devices import ANY_DEVICE
from privfl.errors import ConfigError
from privfl.federation.messages import Message
from privfl.methods.base import (
    ClientContext,
    ClientProcedure,
    ClientState,
    LocalTrainingConfig,
    Strategy,
    register_method,
    supported_modes,
)
from privfl.methods.local_training import local_sgd, sgd_settings, weights_of

#: The privacy modes this method runs, and why it refuses the others.
LOCAL_PRIVACY = supported_modes(
    central="its training clients send nothing, so there is no aggregate to make private",
    distributed="its training clients send nothing, so there is no aggregate to make private")


class LocalStrategy(Strategy):
    """Sends only the round's training settings; there is nothing to aggregate."""

    def round_message(self, round: int) -> Message:
        return Message(config={**self.config.round_config(round), "run_seed": self.seed})

    def aggregate_train(self, round: int, replies: dict[int, Message]) -> dict[str, float]:
        return {}

    def configure_evaluate(self, client_id: int) -> Message:
        return Message(config={"run_seed": self.seed})

    def novel_request(self, client_id: int) -> Message:
        raise ConfigError("method 'local' has no model for novel clients (they have no labels to train on)")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class LocalClient(ClientProcedure):
    """Keeps its own weights in the client state and trains them each round it is sampled."""

    serves_novel_clients = False

    def own_model(self, state: ClientState, run_seed: int):
        if not state:
            state.update(weights_of(self.model_factory.init(run_seed)))
        return self.model_from(state)

    def train(self, data: TrainingClient, message: Message, state: ClientState, ctx: ClientContext) -> None:
        model = self.own_model(state, int(message.config["run_seed"]))
        local_sgd(model, data.x_train, data.y_train, rng=ctx.rng, **sgd_settings(message.config))
        state.update(weights_of(model))
        return None

    def evaluation_model(self, data, message, state):
        return self.own_model(state, int(message.config["run_seed"]))


register_method(
    "local", strategy=LocalStrategy, client=LocalClient, config=LocalTrainingConfig,
    description="Local: every training client trains alone (reported for training clients only)",
    releases_per_round=0,
    privacy=LOCAL_PRIVACY,
    devices=ANY_DEVICE,
    central_eval="every training client trains alone: the server holds no model",
)

"""The ServerApp that ``flwr run`` starts for the deployment engine (``privfl.flower_server:app``, named in
``privfl/federation/flower/app/pyproject.toml``): the engine's :func:`privfl.engine.flower_main` in a Flower
``ServerApp``. A module of its own because importing it needs ``flwr``."""

from privfl.engine import flower_main
from privfl.federation.flower.server_app import make_server_app

app = make_server_app(flower_main)

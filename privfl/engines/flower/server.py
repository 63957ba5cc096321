"""The ServerApp that ``flwr run`` starts for the deployment engine (``privfl.engines.flower.server:app``, named in
``privfl/engines/flower/app/pyproject.toml``): the engine's :func:`privfl.engines.choice.flower_main` in a Flower
``ServerApp``. A module of its own because importing it builds the app and logs to standard output."""

import logging
import sys

from privfl.engines.choice import flower_main
from privfl.engines.flower.server_app import make_server_app

# The ServerApp's output is the run's log (`flwr log RUN_ID`, `privfl flower run --stream`): one line per round.
_progress = logging.getLogger("privfl.engines.flower")
if not _progress.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("privfl: %(message)s"))
    _progress.addHandler(_handler)
    _progress.setLevel(logging.INFO)

app = make_server_app(flower_main)

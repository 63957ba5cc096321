"""The engines: where a run's clients compute. Each drives the one round loop of :mod:`privfl.federation.runtime`.

* :mod:`.choice`: the engine by name (``inprocess``, ``flower-sim``) for :func:`privfl.experiment.train`, and the
  loop that Flower's ServerApp runs (:func:`~.choice.flower_main`);
* :mod:`.flower`: Flower's simulation engine (one machine) and deployment engine (many); importing it needs ``flwr``.

This package sits above the training loop (:mod:`privfl.experiment`), which never imports it: the in-process engine's
runtime (:class:`privfl.federation.runtime.InProcessRuntime`) is the loop's default, shared code below it.
"""

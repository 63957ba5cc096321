"""The golden main job: a reduced ``privfl sweep`` (MNIST through the ScatterNet stage, 10 clients, 30 rounds, the main
job's ODPFL-HN settings, a private training at epsilon 8 and one without DP, seeded noise) whose figures are pinned.
A change to the method, the privacy layer, the data or the feature stage that moves them fails this test: regenerate
the reference on purpose (``PYTHONPATH=. python tests/test_golden.py`` prints the figures to pin) and say why in the
commit. The tolerance is what the same code gives across machines and thread counts (float rounding in the
hypernetwork and DP-SGD), not run-to-run noise: the noise is seeded.
"""

from __future__ import annotations

import sys

import pytest
import torch

from privfl.sweep import SweepConfig, run_sweep

GOLDEN = SweepConfig(clients=10, max_samples=3000, rounds=30, min_samples=255, train_epsilons=(8.0, None),
                     sizes=(50,), epsilons=(1.0,), novel_mixes=2, eval_size=200, repeats=1, noise="seeded")
#: The figures of :data:`GOLDEN` (accuracy in %): per training, the training clients' validation accuracy and the
#: novel clients' accuracy at n = 50 without a private release and at epsilon 1; made at the revision that added them.
PINNED = {
    "8": {"validation": 72.67, "novel": 67.0, "novel_eps1": 67.25},
    "inf": {"validation": 89.11, "novel": 91.75, "novel_eps1": 89.25},
}
TOLERANCE = 1.0   # accuracy points


def figures(result: dict) -> dict:
    found = {}
    for key, training in result["trainings"].items():
        table = training["table"]
        found[key] = {"validation": round(training["training"]["training_val_accuracy"], 2),
                      "novel": round(table["inf"]["50"]["accuracy"], 2),
                      "novel_eps1": round(table["1"]["50"]["accuracy"], 2)}
    return found


@pytest.mark.usefixtures("one_thread")
def test_the_reduced_main_job_reproduces_its_pinned_figures(tmp_path):
    result = run_sweep(GOLDEN, tmp_path / "golden", progress=False)
    found = figures(result)
    assert found.keys() == PINNED.keys()
    for key, pinned in PINNED.items():
        for name, value in pinned.items():
            assert found[key][name] == pytest.approx(value, abs=TOLERANCE), (key, name, found)
    assert result["trainings"]["8"]["training"]["epsilon_max_training"] == pytest.approx(8.0, rel=1e-3)


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        print(figures(run_sweep(GOLDEN, f"{folder}/golden", progress=False)))
    sys.exit(0)

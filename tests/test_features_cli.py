"""``privfl features``: a backbone's features of a data source, written to the ``.npz`` the ``features`` source reads,
then FedPFT trained on them from the command line, end to end (MobileNetV2 at 32 px on 120 MNIST images a split)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from privfl.cli import main
from privfl.data import load_source
from privfl.models import backbones
from privfl.models.backbones import mobilenet_v2

pytestmark = pytest.mark.skipif(not any(p.is_file() for p in backbones._mobilenet_candidates()),
                                reason="the offline MobileNetV2 weights are not installed")
FEATURES = ["features", "--dataset", "mnist", "--backbone", "mobilenet_v2", "--backbone-option", "input_size=32",
            "--max-samples", "120", "--batch-size", "50", "--no-progress"]


def test_features_feed_fedpft_on_the_command_line(tmp_path, capsys, one_thread):
    out = tmp_path / "feats" / "mnist.npz"
    assert main(FEATURES + ["--out", str(out)]) == 0
    assert f"--dataset features --source-option path={out}" in capsys.readouterr().out
    with np.load(out, allow_pickle=False) as archive:
        arrays = {key: archive[key] for key in archive.files}
    assert sorted(arrays) == ["x", "x_test", "y", "y_test"]
    assert arrays["x"].shape == arrays["x_test"].shape == (120, 1280) and arrays["x"].dtype == np.float32
    # the rows are the backbone's features of a seeded subset of each split, with those images' labels
    train = load_source("mnist").train
    index = np.sort(np.random.default_rng(0).choice(len(train.y), size=120, replace=False))
    np.testing.assert_array_equal(arrays["y"], train.y[index])
    expected = mobilenet_v2(input_size=32)(torch.as_tensor(train.x[index[:8]])).numpy()
    np.testing.assert_allclose(arrays["x"][:8], expected, rtol=1e-4, atol=1e-5)
    assert set(np.unique(arrays["y_test"])) <= set(range(10)) and len(np.unique(arrays["y_test"])) > 5

    # refused without --overwrite (nothing computed), replaced with it
    before = out.read_bytes()
    assert main(FEATURES + ["--out", str(out), "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{out} exists; choose another --out, or pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert out.read_bytes() == before
    assert main(FEATURES + ["--out", str(out), "--seed", "1", "--overwrite"]) == 0
    with np.load(out, allow_pickle=False) as archive:
        assert not np.array_equal(archive["y"], arrays["y"])       # another subset
    capsys.readouterr()

    run = tmp_path / "fedpft"
    assert main(["train", "--method", "fedpft", "--dataset", "features", "--source-option", f"path={out}",
                 "--clients", "6", "--rounds", "1", "--out", str(run), "--no-progress"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["method"] == "fedpft" and summary["dataset"] == "features"
    assert summary["novel"]["num_clients"] == 3 and summary["novel"]["accuracy_mean"] > 25.0   # chance: 10%
    config = json.loads((run / "config.json").read_text())
    assert config["federation"]["source_options"] == {"path": str(out)}


@pytest.mark.parametrize("extra,needle", [
    (["--out", "{tmp}/f.txt"], "--out must name a .npz file"),
    (["--dataset", "synthetic"], "source 'synthetic' holds vectors of shape (20,), not images"),
    (["--backbone", "resnet"], "unknown backbone 'resnet'; valid choices: minilm, mobilenet_v2"),
    (["--backbone-option", "width=2"],
     "backbone 'mobilenet_v2' has no option width; valid options: input_size, weights_path, download"),
    (["--backbone-option", "input_size=4"], "input_size must be an integer from 8 to 1024"),
    # was a 1.2 TB allocation and a traceback
    (["--backbone-option", "input_size=100000"], "input_size must be an integer from 8 to 1024 (pixels"),
    (["--backbone-option", "input_size=1024", "--batch-size", "256"],
     "--batch-size 256 images of 1024x1024 pixels take 3.0 GiB a batch before the backbone's activations; use "
     "--batch-size 42 or less"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--source-option", "split=letters"], "source 'mnist' has no option split"),
    (["--out", "{tmp}/folder.npz"], "--out {tmp}/folder.npz cannot be written (it is a folder"),
])
def test_features_user_errors_exit_2_with_one_line(tmp_path, capsys, extra, needle):
    (tmp_path / "folder.npz").mkdir()
    args = FEATURES + ["--out", str(tmp_path / "f.npz")] + [a.replace("{tmp}", str(tmp_path)) for a in extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert needle.replace("{tmp}", str(tmp_path)) in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "f.npz").exists()

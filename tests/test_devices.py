"""Where a run computes (``RunConfig(device=...)``, ``--device``): validation, resolution, and the same numbers."""

import json

import pytest
import torch

from privfl.cli import main
from privfl.config import RunConfig, run_device
from privfl.devices import resolve_device
from privfl.errors import ConfigError
from privfl.experiment import train
from privfl.federation import RunDirectory
from privfl.privacy.training import TrainingPrivacy

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _config(make_spec, **overrides):
    values = {"federation": make_spec(num_clients=8, novel_fraction=0.25), "method": "fedavg",
              "method_config": {"lr": 0.1, "local_steps": 4, "batch_size": 16}, "rounds": 3, "eval_every": 1,
              "select": "last", "seed": 4}
    values.update(overrides)
    return RunConfig(**values)


def _tensors(state):
    from conftest import tensors_by_name

    return tensors_by_name(state)


def test_every_command_offers_the_devices_a_run_accepts():
    from privfl.cli import build_parser
    from privfl.devices import DEVICES

    commands = build_parser()._subparsers._group_actions[0].choices
    offered = {name: next(a.choices for a in commands[name]._actions if a.dest == "device")
               for name in ("train", "demo", "sweep", "features")}
    assert offered == dict.fromkeys(offered, DEVICES)


@pytest.mark.parametrize("device", ["gpu", "cuda:0", "", None, 0])
def test_an_unknown_device_is_refused_by_name(make_spec, device):
    with pytest.raises(ConfigError, match=f"device must be one of auto, cpu, cuda, got {device!r}"):
        _config(make_spec, device=device)


@no_cuda
def test_cuda_where_there_is_none_is_refused_in_one_line_naming_auto_and_cpu(make_spec, tmp_path, capsys):
    with pytest.raises(ConfigError, match="device 'cuda' is not available here .* use device 'auto' .* or 'cpu'"):
        resolve_device("cuda")
    assert main(["train", "--out", str(tmp_path / "r"), "--dataset", "synthetic", "--clients", "8", "--rounds", "1",
                 "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "'auto'" in err and "'cpu'" in err and "Traceback" not in err
    assert not (tmp_path / "r" / "summary.json").exists()


@no_cuda
def test_auto_computes_on_the_cpu_here_and_the_summary_says_so(make_spec, tmp_path):
    summary = train(_config(make_spec, device="auto", rounds=1), str(tmp_path / "run"), progress=False)
    assert summary["numerics"]["device"] == "cpu"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["device"] == "auto"


def test_which_methods_take_cuda_where_it_exists(make_spec, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run_device(_config(make_spec, device="cuda")) == "cuda"
    assert run_device(_config(make_spec, device="auto")) == "cuda"
    assert run_device(_config(make_spec, method="scaffold", method_config={}, device="auto")) == "cuda"
    assert run_device(_config(make_spec, device="auto", workers=2)) == "cpu"    # workers train on the CPU
    assert run_device(_config(make_spec, method="pfedhn", method_config={}, device="auto")) == "cpu"
    with pytest.raises(ConfigError, match=r"method 'pfedhn' runs on the CPU only.*runs fedavg, fedprox, local, "
                                          r"scaffold\); use device 'cpu' or 'auto'"):
        run_device(_config(make_spec, method="pfedhn", method_config={}, device="cuda"))
    with pytest.raises(ConfigError, match="device 'cuda' with workers=2"):
        _config(make_spec, device="cuda", workers=2)


@needs_cuda
@pytest.mark.parametrize("method, privacy", [
    ("fedavg", TrainingPrivacy(mode="record", noise_multiplier=1.1, clip=1.0, noise="seeded")),
    ("fedprox", TrainingPrivacy()),
    ("scaffold", TrainingPrivacy()),
])
def test_cuda_gives_the_cpu_numbers_within_float_tolerance(make_spec, tmp_path, method, privacy):
    settings = {"lr": 0.1, "local_steps": 4, "batch_size": 16, **({"mu": 0.01} if method == "fedprox" else {})}
    runs = {}
    for device in ("cpu", "cuda"):
        summary = train(_config(make_spec, method=method, method_config=settings, privacy=privacy, device=device),
                        str(tmp_path / device), progress=False)
        assert summary["numerics"]["device"] == device
        directory = RunDirectory(tmp_path / device)
        runs[device] = (directory.read_metrics(), summary,
                        torch.load(directory.path("checkpoint.pt"), weights_only=True)["runtime"]["strategy"])
    (cpu_metrics, cpu, cpu_state), (gpu_metrics, gpu, gpu_state) = runs["cpu"], runs["cuda"]
    for a, b in zip(cpu_metrics, gpu_metrics, strict=True):
        for key in ("train_loss", "val_loss_mean", "val_accuracy_mean"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), key
    assert gpu["novel"]["accuracy_mean"] == pytest.approx(cpu["novel"]["accuracy_mean"], abs=1.0)
    tensors = _tensors(cpu_state)
    assert tensors and tensors.keys() == _tensors(gpu_state).keys()
    for name, value in tensors.items():
        on_gpu = _tensors(gpu_state)[name]
        assert on_gpu.device.type == "cpu"      # the server's state stays on the CPU
        torch.testing.assert_close(on_gpu, value, rtol=1e-3, atol=1e-4)

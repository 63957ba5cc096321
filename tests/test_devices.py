"""Where a run computes (``RunConfig(device=...)``, ``--device``): validation, resolution, and the same numbers."""

import dataclasses
import json
import math
import re

import pytest
import torch

from privfl.cli import main
from privfl.config import RunConfig, run_device
from privfl.devices import resolve_device
from privfl.errors import ConfigError
from privfl.experiment import train
from privfl.federation import RunDirectory
from privfl.methods import METHODS
from privfl.privacy.training import NovelPrivacy, TrainingPrivacy

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is absent")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: Where each registered method computes, as its MethodSpec declares (``devices``).
ON_CUDA = sorted(name for name, spec in METHODS.items() if "cuda" in spec.devices)
CPU_ONLY = sorted(set(METHODS) - set(ON_CUDA))


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
    # each method's MethodSpec says where it computes (devices=ANY_DEVICE or the CPU only); this reads them all
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "fedavg" in ON_CUDA and CPU_ONLY
    assert run_device(_config(make_spec, device="cuda")) == "cuda"
    assert run_device(_config(make_spec, device="auto", workers=2)) == "cpu"    # workers train on the CPU
    for name in ON_CUDA:
        for device in ("auto", "cuda"):
            assert run_device(_config(make_spec, method=name, method_config={}, device=device)) == "cuda", name
    for name in CPU_ONLY:
        assert run_device(_config(make_spec, method=name, method_config={}, device="auto")) == "cpu", name
        with pytest.raises(ConfigError, match=rf"method '{name}' runs on the CPU only.*runs "
                                              rf"{re.escape(', '.join(ON_CUDA))}\); use device 'cpu' or 'auto'"):
            run_device(_config(make_spec, method=name, method_config={}, device="cuda"))
    with pytest.raises(ConfigError, match="device 'cuda' with workers=2"):
        _config(make_spec, device="cuda", workers=2)


#: A few local steps; each method's smoke settings (small networks, the batch clip off where record-level DP-SGD
#: refuses it) add the rest.
_QUICK = {"lr": 0.1, "local_steps": 4, "batch_size": 16}
_RECORD = TrainingPrivacy(mode="record", noise_multiplier=1.1, clip=1.0, noise="seeded", min_samples=4)
_NOVEL = NovelPrivacy(epsilon=4.0, noise="seeded")


def _cuda_cases():
    """Every method that runs on CUDA, without DP and with record-level DP-SGD where it takes it (with its private
    novel-client release where it has one), then paths that only some settings reach."""
    cases = []
    for name in ON_CUDA:
        spec = METHODS[name]
        cases.append(pytest.param(name, TrainingPrivacy(), NovelPrivacy(), {}, id=f"{name}-none"))
        if spec.privacy["record"] is None:
            novel = _NOVEL if spec.novel_privacy is None and spec.client.serves_novel_clients else NovelPrivacy()
            cases.append(pytest.param(name, _RECORD, novel, {}, id=f"{name}-record"))
    return cases + [
        # central DP's contributions to a hypernetwork, ODPFL-HN's noisy training means and batch-mean descriptors
        pytest.param("pfedhn", TrainingPrivacy(mode="central", noise_multiplier=0.5, clip=1.0, noise="seeded"),
                     NovelPrivacy(), {}, id="pfedhn-central"),
        pytest.param("odpflhn", TrainingPrivacy(), NovelPrivacy(),
                     {"train_mean_noise": 0.1, "descriptor": "batch_mean", "descriptor_batch_size": 8},
                     id="odpflhn-none-batch_mean"),
    ]


@needs_cuda
@pytest.mark.parametrize("method, privacy, novel_privacy, settings", _cuda_cases())
def test_cuda_gives_the_cpu_numbers_within_float_tolerance(make_spec, tmp_path, method, privacy, novel_privacy,
                                                           settings):
    fields = {f.name for f in dataclasses.fields(METHODS[method].config)}
    settings = {k: v for k, v in _QUICK.items() if k in fields} | dict(METHODS[method].smoke_settings) | settings
    runs = {}
    for device in ("cpu", "cuda"):
        summary = train(_config(make_spec, method=method, method_config=settings, privacy=privacy,
                                novel_privacy=novel_privacy, device=device), str(tmp_path / device), progress=False)
        assert summary["numerics"]["device"] == device
        directory = RunDirectory(tmp_path / device)
        runs[device] = (directory.read_metrics(), summary,
                        torch.load(directory.path("checkpoint.pt"), weights_only=True)["runtime"]["strategy"])
    (cpu_metrics, cpu, cpu_state), (gpu_metrics, gpu, gpu_state) = runs["cpu"], runs["cuda"]
    for a, b in zip(cpu_metrics, gpu_metrics, strict=True):
        # every number the method reports (train_loss and val_* for all; hn_grad_norm, encoder_grad_norm,
        # server_grad_norm, clip where the method has them); a loss no client sends under DP is NaN on both
        assert a.keys() == b.keys()
        numbers = [key for key, value in a.items() if isinstance(value, float)]
        assert "val_loss_mean" in numbers
        for key in numbers:
            if math.isnan(a[key]):
                assert math.isnan(b[key]), key
            else:
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), key
        assert {k: v for k, v in a.items() if k not in numbers} == {k: v for k, v in b.items() if k not in numbers}
    if cpu["novel"]["accuracy_mean"] is None:     # a method that serves no novel client (pfedhn, pefll here)
        assert gpu["novel"]["accuracy_mean"] is None
    else:
        assert gpu["novel"]["accuracy_mean"] == pytest.approx(cpu["novel"]["accuracy_mean"], abs=1.0)
    tensors = _tensors(cpu_state)
    assert tensors and tensors.keys() == _tensors(gpu_state).keys()
    for name, value in tensors.items():
        on_gpu = _tensors(gpu_state)[name]
        assert on_gpu.device.type == "cpu"      # the server's state stays on the CPU
        torch.testing.assert_close(on_gpu, value, rtol=1e-3, atol=1e-4)

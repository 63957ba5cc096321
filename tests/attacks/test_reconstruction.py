"""The diffusion reconstructor, the release schemes, the selections and the attack CLI's validation."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

# `.venv/bin/pytest` (unlike `python -m pytest`) does not put the repository root on sys.path, and the test folder
# tests/accounting then shadows the `accounting` package as a namespace package; make the real one win.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from accounting import epsilon as accountant_epsilon  # noqa: E402
from accounting import event_from_dict  # noqa: E402
from attacks.metrics import LPIPS, psnr_pairs, ssim_pairs  # noqa: E402
from attacks.reconstruct_cli import build_parser, reconstruct_main, settings_from_args  # noqa: E402
from attacks.reconstruct_settings import PRESETS, reconstructor_config  # noqa: E402
from attacks.reconstructor import Reconstructor, file_sha256, train_or_resume  # noqa: E402
from attacks.reconstructor_config import (  # noqa: E402
    ReconstructorConfig,
    SamplingSettings,
    resolve_device,
    resolve_precision,
)
from attacks.sampling_choice import select_one_step_guidance, select_sampling  # noqa: E402
from attacks.schemes import (  # noqa: E402
    AttackerPrior,
    Release,
    feature_diagnostics,
    make_release,
    postprocess_release,
    prior_only_release,
)
from attacks.scoring import (  # noqa: E402
    AttackRow,
    ScoredSet,
    evaluate_decoder,
    evaluate_release,
    nearest_image_baseline,
    rows_from_scores,
    score_reconstructions,
)
from attacks.selection import agreement_scores, near_duplicate_filter, nearest, top_count, top_indices  # noqa: E402
from privfl.errors import ConfigError  # noqa: E402
from privfl.methods.fedpft import payload_bytes  # noqa: E402

torch.set_num_threads(1)


def tiny_config(**overrides) -> ReconstructorConfig:
    values = dict(feature_dim=4, image_size=16, channels=1, block_channels=(8, 16), layers_per_block=1, norm_groups=4,
                  batch_size=16, learning_rate=2e-3, train_timesteps=100)
    values.update(overrides)
    return ReconstructorConfig(**values)


def tiny_data(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images that are a bright square whose position is given by the feature (so the condition matters)."""
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 4, generator=g)
    images = torch.zeros(n, 1, 16, 16)
    for i, f in enumerate(features):
        r, c = (int(v) for v in ((f[:2] > 0).long() * 8))
        images[i, 0, r:r + 8, c:c + 8] = 1.0
    return features, images


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.state_dict().values()]


# -- the reconstructor ----------------------------------------------------------------------------------------------

def test_loss_decreases_on_tiny_data():
    features, images = tiny_data()
    r = Reconstructor(tiny_config(), seed=0)
    losses = r.fit(features, images, steps=40, progress=False)
    assert len(losses) == 40 and r.step == 40
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])


class ZeroNet(torch.nn.Module):
    """A network that predicts 0 and records the batch sizes and keep masks it is called with."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int]] = []

    def forward(self, x, t, features, keep=None):
        self.calls.append((len(x), -1 if keep is None else int(keep.sum())))
        return torch.zeros_like(x)


@pytest.mark.parametrize("prediction_type", ["v_prediction", "epsilon"])
def test_the_loss_target_is_the_velocity_or_the_noise(prediction_type):
    features, images = tiny_data()
    r = Reconstructor(tiny_config(prediction_type=prediction_type), seed=2)
    r.model = ZeroNet()   # the loss is then the mean square of the target itself
    state = r.generator.get_state()
    loss = float(r.training_loss(images[:8], features[:8]))
    r.generator.set_state(state)
    t = torch.randint(0, 100, (8,), generator=r.generator)
    eps = torch.randn((8, 1, 16, 16), generator=r.generator)
    abar = r.noise_scheduler.alphas_cumprod[t].view(-1, 1, 1, 1)
    x0 = images[:8] * 2 - 1
    target = eps if prediction_type == "epsilon" else abar.sqrt() * eps - (1 - abar).sqrt() * x0   # Salimans & Ho
    assert loss == pytest.approx(float(target.pow(2).mean()), rel=1e-5)


def test_checkpoint_resume_gives_the_same_weights(tmp_path):
    features, images = tiny_data()
    straight = Reconstructor(tiny_config(), seed=3)
    straight.fit(features, images, steps=4, progress=False)

    path = tmp_path / "rec.pt"
    first = Reconstructor(tiny_config(), seed=3)
    first.fit(features, images, steps=2, checkpoint=path, progress=False)
    assert path.is_file() and not (tmp_path / "rec.pt.tmp").exists()
    resumed = train_or_resume(tiny_config(), features, images, steps=4, checkpoint=path, seed=3, progress=False)
    assert resumed.step == 4
    for a, b in zip(params(straight.model), params(resumed.model)):
        assert torch.equal(a, b)
    for a, b in zip(params(straight.ema), params(resumed.ema)):
        assert torch.equal(a, b)
    assert resumed.losses == straight.losses
    reloaded = Reconstructor.load(path)  # torch.load(weights_only=True)
    assert reloaded.step == 4 and reloaded.config == tiny_config()
    with pytest.raises(ConfigError, match="other"):
        resumed.fit(features + 1, images, steps=5, progress=False)
    state = torch.load(path, weights_only=True)
    torch.save({**state, "format": 2}, tmp_path / "old.pt")   # the 16 px eps-prediction reconstructor's format
    with pytest.raises(ConfigError, match="format 2"):
        Reconstructor.load(tmp_path / "old.pt")


def test_exported_weights_sample_like_the_trained_model_and_accept_only_its_data(tmp_path):
    """Train on one machine, attack on another: the exported EMA weights sample exactly as the trained model does,
    are accepted on the same images with features that differ by a device's rounding, and refuse anything else."""
    features, images = tiny_data()
    trained = train_or_resume(tiny_config(), features, images, steps=3, checkpoint=tmp_path / "full.pt", seed=1,
                              progress=False)
    exported = Reconstructor.load(trained.export(tmp_path / "weights.pt"))
    assert exported.exported and exported.step == 3 and exported.losses == trained.losses
    assert (tmp_path / "weights.pt").stat().st_size < 0.6 * (tmp_path / "full.pt").stat().st_size  # no optimiser
    draw = dict(guidance_scale=1.5, num_inference_steps=3)
    assert torch.equal(exported.sample(features[:5], **draw), trained.sample(features[:5], **draw))

    rounding = features + 1e-6 * torch.randn(features.shape, generator=torch.Generator().manual_seed(0))
    assert exported.fit(rounding, images, steps=3, progress=False) == []   # accepted, nothing trained
    again = train_or_resume(tiny_config(), rounding, images, steps=3, checkpoint=tmp_path / "weights.pt",
                            progress=False)
    assert again.exported and again.step == 3
    with pytest.raises(ConfigError, match=r"differ from the exported weights' training features by 0\.01\d* "
                                          r"in a per-dimension mean"):
        exported.fit(features + 0.01, images, steps=3, progress=False)
    with pytest.raises(ConfigError, match="trained on 32 other images than the 32 given"):
        exported.fit(features, images.flip(-1), steps=3, progress=False)
    with pytest.raises(ConfigError, match="trained on 32 other images than the 31 given"):
        exported.fit(features[:31], images[:31], steps=3, progress=False)
    with pytest.raises(ConfigError, match="exported weights trained for 3 steps.*cannot train on to 4 steps; ask for "
                                          "steps=3"):
        exported.fit(features, images, steps=4, progress=False)
    with pytest.raises(ConfigError, match="no optimiser state to checkpoint"):
        exported.save(tmp_path / "again.pt")
    with pytest.raises(ConfigError, match="no summary of its training data"):
        Reconstructor(tiny_config(), seed=0).export(tmp_path / "untrained.pt")


def test_weights_carry_their_sha256_and_the_command_that_trained_them_into_exported_files(tmp_path):
    """Exported weights evaluated elsewhere name how they were made: the training call's command travels with the
    checkpoint and the exported file, and the EMA weights' sha256 is the same in both and in a fine-tuned
    reconstructor's record of its source."""
    import hashlib

    features, images = tiny_data()
    command = "privfl attack reconstruct --preset quick --steps 3"
    trained = train_or_resume(tiny_config(), features, images, steps=3, checkpoint=tmp_path / "full.pt", seed=1,
                              made_by=command, progress=False)
    exported = Reconstructor.load(trained.export(tmp_path / "weights.pt"))
    assert trained.made_by == exported.made_by == Reconstructor.load(tmp_path / "full.pt").made_by == command
    assert exported.weights_sha256() == trained.weights_sha256() == Reconstructor.load(
        tmp_path / "full.pt").weights_sha256()
    # evaluating exported weights (nothing trained) keeps the command that made them
    again = train_or_resume(tiny_config(), features, images, steps=3, checkpoint=tmp_path / "weights.pt",
                            made_by="privfl attack reconstruct --checkpoint weights.pt", progress=False)
    assert again.made_by == command
    tuned = Reconstructor(tiny_config(), seed=2)
    tuned.initialise_from(tmp_path / "weights.pt")
    assert tuned.initialised_from["weights_sha256"] == trained.weights_sha256()
    assert tuned.initialised_from["file_sha256"] == file_sha256(tmp_path / "weights.pt") == hashlib.sha256(
        (tmp_path / "weights.pt").read_bytes()).hexdigest()
    tuned.fit(features, images, steps=1, progress=False)
    assert tuned.weights_sha256() != trained.weights_sha256()


def test_fine_tuning_starts_from_the_source_ema_keeps_its_whitening_and_names_it(tmp_path):
    """A reconstructor fine-tuned from exported weights starts at their EMA weights with a fresh optimiser, keeps
    the source's feature whitening, records the source, resumes only from the same source, and refuses another
    architecture."""
    features, images = tiny_data()
    source = train_or_resume(tiny_config(), features, images, steps=3, checkpoint=None, seed=1, progress=False)
    weights = source.export(tmp_path / "weights.pt")
    tuned = Reconstructor(tiny_config(learning_rate=1e-3, batch_size=8), seed=2)   # training settings may differ
    tuned.initialise_from(weights)
    assert all(torch.equal(a, b) for a, b in zip(params(tuned.model), params(source.ema)))
    assert all(torch.equal(a, b) for a, b in zip(params(tuned.ema), params(source.ema)))
    assert tuned.initialised_from["step"] == 3 and tuned.initialised_from["file"] == "weights.pt"
    shifted = features * 3 + 1   # other features: the whitening stays the source's
    tuned.fit(shifted, images, steps=2, progress=False, checkpoint=tmp_path / "tuned.pt")
    assert tuned.step == 2 and len(tuned.losses) == 2
    assert torch.equal(tuned.ema.feature_mean, source.ema.feature_mean)
    assert torch.equal(tuned.ema.feature_projection, source.ema.feature_projection)
    assert not torch.equal(tuned.model.unet.conv_in.weight, source.ema.unet.conv_in.weight)   # it trained
    # Saved and resumed with the same source; exported weights carry the source too.
    resumed = train_or_resume(tiny_config(learning_rate=1e-3, batch_size=8), shifted, images, steps=3,
                              checkpoint=tmp_path / "tuned.pt", init_weights=weights, progress=False)
    assert resumed.step == 3 and resumed.initialised_from == tuned.initialised_from
    assert Reconstructor.load(resumed.export(tmp_path / "t.pt")).initialised_from["step"] == 3
    other = source.export(tmp_path / "other.pt")
    source.fit(features, images, steps=4, progress=False)
    source.export(other)
    with pytest.raises(ConfigError, match="was not fine-tuned from"):
        train_or_resume(tiny_config(learning_rate=1e-3, batch_size=8), shifted, images, steps=3,
                        checkpoint=tmp_path / "tuned.pt", init_weights=other, progress=False)
    with pytest.raises(ConfigError, match=r"another architecture.*'layers_per_block': \(1, 2\)"):
        Reconstructor(tiny_config(layers_per_block=2), seed=0).initialise_from(weights)
    with pytest.raises(ConfigError, match="has trained or was loaded"):
        tuned.initialise_from(weights)


@pytest.fixture(scope="module")
def conditioned() -> Reconstructor:
    features, images = tiny_data()
    r = Reconstructor(tiny_config(cond_dropout=0.0), seed=1)
    r.fit(features, images, steps=8, progress=False)
    return r


def _sample(r: Reconstructor, features: torch.Tensor, w: float) -> torch.Tensor:
    return r.sample(features, guidance_scale=w, num_inference_steps=4, generator=torch.Generator().manual_seed(7))


def test_guidance_is_wired(conditioned):
    a, b = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)), torch.zeros(3, 4)
    assert conditioned.model.condition[2].weight.abs().sum() > 0  # the zero-initialised projection has learnt
    guided, unconditional = _sample(conditioned, a, 3.0), _sample(conditioned, a, 0.0)
    assert guided.shape == (3, 1, 16, 16) and 0 <= float(guided.min()) and float(guided.max()) <= 1
    assert (guided - unconditional).abs().max() > 1e-4
    assert (_sample(conditioned, a, 3.0) - _sample(conditioned, b, 3.0)).abs().max() > 1e-4
    # w = 0 is the unconditional model: the features do not matter.
    assert torch.equal(unconditional, _sample(conditioned, b, 0.0))
    # Deterministic DDIM given the starting noise.
    assert torch.equal(guided, _sample(conditioned, a, 3.0))


def test_condition_dropout_one_ignores_the_condition():
    features, images = tiny_data()
    r = Reconstructor(tiny_config(cond_dropout=1.0), seed=1)
    state = r.generator.get_state()
    loss_a = r.training_loss(images[:8], features[:8])
    r.generator.set_state(state)
    loss_b = r.training_loss(images[:8], torch.randn(8, 4))
    assert float(loss_a.detach()) == float(loss_b.detach())
    r.fit(features, images, steps=6, progress=False)
    assert r.model.condition[2].weight.abs().sum() == 0  # never received a gradient
    a, b = torch.randn(2, 4), torch.randn(2, 4) * 5
    assert torch.equal(_sample(r, a, 3.0), _sample(r, b, 3.0))
    # With dropout 0 the same loss does depend on the condition once the projection is non-zero.
    r0 = Reconstructor(tiny_config(cond_dropout=0.0), seed=1)
    r0.fit(features, images, steps=3, progress=False)
    state = r0.generator.get_state()
    loss_a = r0.training_loss(images[:8], features[:8])
    r0.generator.set_state(state)
    assert float(loss_a.detach()) != float(r0.training_loss(images[:8], torch.randn(8, 4)).detach())


def test_the_decoder_estimate_is_read_and_dropped_with_the_condition(tmp_path):
    features, images = tiny_data()
    guides = images.flip(-1)   # any stand-in for a decoder's estimates
    r = Reconstructor(tiny_config(guide_image=True), seed=0)
    assert r.model.unet.conv_in.in_channels == 2
    x, t = torch.randn(4, 1, 16, 16), torch.tensor([3, 50, 7, 90])
    keep, drop = torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool)
    with torch.no_grad():
        assert not torch.allclose(r.model(x, t, features[:4], keep, guide=guides[:4]),
                                  r.model(x, t, features[:4], keep, guide=images[:4]))
        # without the condition the estimate is not seen either: the unconditional model stays unconditional
        assert torch.equal(r.model(x, t, features[:4], drop, guide=guides[:4]),
                           r.model(x, t, features[:4], drop, guide=images[:4]))
    with pytest.raises(ConfigError, match="pass guides"):
        r.fit(features, images, steps=1, progress=False)
    with pytest.raises(ConfigError, match=r"guides must be finite images of shape \[32, 1, 16, 16\]"):
        r.fit(features, images, guides=guides[:5], steps=1, progress=False)
    with pytest.raises(ConfigError, match="without guide_image"):
        Reconstructor(tiny_config(), seed=0).fit(features, images, guides=guides, steps=1, progress=False)
    path = tmp_path / "guided.pt"
    r.fit(features, images, guides=guides, steps=2, checkpoint=path, progress=False)
    out = r.sample(features[:3], guide=guides[:3], num_inference_steps=2)
    assert out.shape == (3, 1, 16, 16) and torch.equal(out, r.sample(features[:3], guide=guides[:3],
                                                                     num_inference_steps=2))
    mean = r.posterior_mean(features[:3], guide=guides[:3], draws=2)
    assert mean.shape == (3, 1, 16, 16) and not torch.allclose(mean, r.posterior_mean(features[:3],
                                                                                       guide=images[:3], draws=2))
    with pytest.raises(ConfigError, match="pass guides"):
        r.posterior_mean(features[:3])
    with pytest.raises(ConfigError, match="other"):   # the estimates are part of the training data's fingerprint
        train_or_resume(tiny_config(guide_image=True), features, images, guides=images, steps=3, checkpoint=path,
                        progress=False)


def test_config_errors_name_the_value():
    with pytest.raises(ConfigError, match="norm_groups=3"):
        tiny_config(norm_groups=3)
    with pytest.raises(ConfigError, match="cond_dropout"):
        tiny_config(cond_dropout=1.5)
    with pytest.raises(ConfigError, match="beta_schedule"):
        tiny_config(beta_schedule="cubic")
    with pytest.raises(ConfigError, match="prediction_type must be one of v_prediction, epsilon, got 'x0'"):
        tiny_config(prediction_type="x0")
    r = Reconstructor(tiny_config(), seed=0)
    with pytest.raises(ConfigError, match=r"\[n, 4\]"):
        r.sample(torch.zeros(2, 5))
    with pytest.raises(ConfigError, match="guidance_scale"):
        r.sample(torch.zeros(2, 4), guidance_scale=-1)


def test_default_size_and_attention_are_what_the_docstring_says():
    config = ReconstructorConfig(feature_dim=1280)
    assert (config.image_size, config.block_channels, config.layers_per_block) == (28, (32, 64, 128), 2)
    r = Reconstructor(config, seed=0)
    assert r.num_parameters == 3_965_601
    assert all(len(b.resnets) == 2 for b in r.model.unet.down_blocks)   # two residual blocks per level
    assert r.model.unet.mid_block.attentions[0] is not None  # diffusers' add_attention, on by default
    assert not any("Attn" in type(b).__name__ for b in r.model.unet.down_blocks)
    assert r.model.unet(torch.zeros(1, 1, 28, 28), 5, class_labels=torch.zeros(1, 128)).sample.shape == (1, 1, 28, 28)
    old = ReconstructorConfig(feature_dim=1280, image_size=16, block_channels=(32, 64, 64), layers_per_block=1)
    assert Reconstructor(old, seed=0).num_parameters == 1_321_281   # the first version's default
    whitened = Reconstructor(replace(old, condition_dims=128), seed=0)
    assert whitened.num_parameters == 1_173_825
    plain = Reconstructor(replace(old, mid_attention=False), seed=0)
    assert plain.model.unet.mid_block.attentions[0] is None and plain.num_parameters < 1_321_281
    deep = Reconstructor(ReconstructorConfig(feature_dim=4, image_size=16, attention=True), seed=0)
    assert type(deep.model.unet.down_blocks[-1]).__name__ == "AttnDownBlock2D"


def test_whitening_is_pca_of_the_attackers_features():
    g = torch.Generator().manual_seed(0)
    # features with very different scales along three orthogonal directions (plus a little isotropic noise)
    basis = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    coords = torch.randn(400, 6, generator=g, dtype=torch.float64) * torch.tensor([5.0, 2.0, 0.5, 1e-3, 1e-3, 1e-3])
    features = (coords @ basis.T + 3.0).float()
    r = Reconstructor(tiny_config(feature_dim=6, condition_dims=3), seed=0)
    r.set_feature_statistics(features)
    white = r.model.whiten(features).double()
    assert white.shape == (400, 3)
    assert torch.allclose(white.mean(0), torch.zeros(3, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(white.T @ white / 400, torch.eye(3, dtype=torch.float64), atol=1e-3)  # whitened
    # the kept subspace is the top three directions: the tiny ones are dropped
    kept = r.model.feature_projection.double()
    assert torch.allclose((basis[:, 3:].T @ kept).abs().max(), torch.tensor(0.0, dtype=torch.float64), atol=1e-3)
    assert torch.equal(r.ema.feature_projection, r.model.feature_projection)
    with pytest.raises(ConfigError, match="condition_dims=7 must be at most feature_dim=6"):
        tiny_config(feature_dim=6, condition_dims=7)
    with pytest.raises(ConfigError, match="needs more than 3 training pairs"):
        r.set_feature_statistics(features[:3])


class Recorder(torch.nn.Module):
    """out(x, t, f, keep) = x + t + (sum of f where kept): known conditional and unconditional outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def forward(self, x, t, features, keep):
        self.calls.append(len(x))
        cond = (features.sum(1) * keep.to(x.dtype)).view(-1, 1, 1, 1)
        return x + t.view(-1, 1, 1, 1).to(x.dtype) + cond


def test_guided_output_is_unconditional_plus_w_times_the_difference():
    r = Reconstructor(tiny_config(), seed=0)
    r.ema = recorder = Recorder()
    x = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    f = torch.tensor([[1.0, 0, 0, 0], [0, 2.0, 0, 0], [-1.0, 0, 0, 3.0]])
    t = torch.tensor(7)
    u = x + 7.0
    c = u + f.sum(1).view(-1, 1, 1, 1)
    for w in (2.5, 0.3, 7.0):
        assert torch.allclose(r.guided_output(x, t, f, w), u + w * (c - u), atol=1e-6)
    assert recorder.calls == [6, 6, 6]  # one batched pass with both halves
    assert torch.equal(r.guided_output(x, t, f, 1.0), c) and torch.equal(r.guided_output(x, t, f, 0.0), u)
    assert recorder.calls[3:] == [3, 3]  # w = 1 and w = 0 need one half only
    # guidance rescale (Lin et al. 2024, eq. 16): phi = 1 gives the guided output at the conditional one's std
    guided = u + 3.0 * (c - u)
    dims = (1, 2, 3)
    rescaled = guided * c.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True)
    assert torch.allclose(r.guided_output(x, t, f, 3.0, 1.0), rescaled, atol=1e-5)
    assert torch.allclose(r.guided_output(x, t, f, 3.0, 0.5), 0.5 * rescaled + 0.5 * guided, atol=1e-5)


def test_guidance_interval_and_decoder_guided_start():
    r = Reconstructor(tiny_config(), seed=0)   # T = 100: trailing DDIM timesteps 99, 74, 49, 24 for 4 steps
    r.ema = zero = ZeroNet()
    f = torch.zeros(3, 4)
    r.sample(f, settings=SamplingSettings(guidance_scale=2.0, guidance_interval=(0.4, 0.8), num_inference_steps=4))
    assert zero.calls == [(3, 3), (6, 3), (6, 3), (3, 3)]   # w applies at t = 74 and 49 only (t / 99 in [0.4, 0.8])
    zero.calls.clear()
    init = torch.as_tensor(_blocks(), dtype=torch.float32)[:3]
    out = r.sample(f, settings=SamplingSettings(num_inference_steps=4, init_strength=0.3), init=init,
                   generator=torch.Generator().manual_seed(5))
    assert zero.calls == [(3, 3)]   # SDEdit from t = 24 <= 0.3 * 99: one step
    # v = 0: the step's x_0 estimate is sqrt(abar_24) x_24 with x_24 = sqrt(abar_24) x_init + sqrt(1 - abar_24) eps,
    # and the last DDIM step returns it (alpha_prev = 1)
    abar = r.noise_scheduler.alphas_cumprod[24]
    eps = torch.randn((3, 1, 16, 16), generator=torch.Generator().manual_seed(5))
    x0 = abar.sqrt() * (abar.sqrt() * (init * 2 - 1) + (1 - abar).sqrt() * eps)
    assert torch.allclose(out, (x0.clamp(-1, 1) + 1) / 2, atol=1e-5)
    with pytest.raises(ConfigError, match="both init images and init_strength"):
        r.sample(f, settings=SamplingSettings(init_strength=0.3))
    with pytest.raises(ConfigError, match="guidance_interval"):
        SamplingSettings(guidance_interval=(0.8, 0.2))


class VelocityNet(torch.nn.Module):
    """v(x, t, f) = 0.5 x + 0.01 t + sum(f) where the condition is kept: a known network output."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, list[int], int]] = []

    def forward(self, x, t, features, keep):
        self.calls.append((len(x), t.tolist(), int(keep.sum())))
        cond = (features.sum(1) * keep.to(x.dtype)).view(-1, 1, 1, 1)
        return 0.5 * x + 0.01 * t.view(-1, 1, 1, 1).to(x.dtype) + cond


def test_posterior_mean_is_the_v_prediction_x0_at_the_last_timestep():
    # linear betas 1e-4..0.02 over T = 100: abar_99 = 0.366, so sqrt(abar) and sqrt(1 - abar) are far apart and a
    # wrong timestep (abar_98 = 0.373), an eps/v swap or a missing clamp changes the value
    r = Reconstructor(tiny_config(beta_schedule="linear"), seed=0)
    r.ema = net = VelocityNet()
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, 100, dtype=torch.float64), 0)
    assert float(r.noise_scheduler.alphas_cumprod[99]) == pytest.approx(float(abar[99]), rel=1e-6)
    a, s = float(abar[99].sqrt()), float((1 - abar[99]).sqrt())
    f = torch.tensor([[-0.8, 0.0, 0.0, 0.0], [0.0, -1.2, 0.1, 0.0], [-1.0, -1.0, 0.0, 0.5]])

    def hand(x: torch.Tensor, w: float = 1.0) -> torch.Tensor:
        # x_0 = sqrt(abar) x_T - sqrt(1 - abar) v (Salimans and Ho, sec. 4); guided v = v_u + w (v_c - v_u)
        v = 0.5 * x + 0.99 + w * f.sum(1).view(-1, 1, 1, 1)
        return a * x - s * v

    noise = torch.randn((3, 1, 16, 16), generator=torch.Generator().manual_seed(3))
    one = r.posterior_mean(f, draws=1, generator=torch.Generator().manual_seed(3))
    expected = (hand(noise).clamp(-1, 1) + 1) / 2
    assert one.shape == (3, 1, 16, 16) and one.device.type == "cpu"
    assert torch.allclose(one, expected, atol=1e-6)
    assert 0.05 < float(expected.std()) and float(((hand(noise) > -1) & (hand(noise) < 1)).float().mean()) > 0.9
    assert net.calls == [(3, [99, 99, 99], 3)]   # one conditional pass at t = T - 1
    # draws: the predictions of antithetic pairs (x, -x) of noise draws averaged, then clamped; an odd count ends
    # with an unpaired draw
    g = torch.Generator().manual_seed(4)
    first, second = (torch.randn((3, 1, 16, 16), generator=g) for _ in range(2))
    draws = [first, -first, second]
    three = r.posterior_mean(f, draws=3, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(three, (torch.stack([hand(x) for x in draws]).mean(0).clamp(-1, 1) + 1) / 2, atol=1e-6)
    # the same generator gives the same estimate, also in other batches; another seed another one
    again = r.posterior_mean(f, draws=3, generator=torch.Generator().manual_seed(4))
    assert torch.equal(three, again)
    assert not torch.allclose(three, r.posterior_mean(f, draws=3, generator=torch.Generator().manual_seed(5)))
    single = r.posterior_mean(f[:1], draws=1, generator=torch.Generator().manual_seed(3), batch_size=1)
    assert torch.allclose(single, expected[:1], atol=1e-6)
    # a guidance scale w != 1: a conditional and an unconditional pass, extrapolated
    net.calls.clear()
    guided = r.posterior_mean(f, draws=1, guidance_scale=1.5, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(guided, (hand(noise, 1.5).clamp(-1, 1) + 1) / 2, atol=1e-6)
    assert not torch.allclose(guided, one) and net.calls == [(6, [99] * 6, 3)]
    with pytest.raises(ConfigError, match="draws must be an integer >= 1, got 0"):
        r.posterior_mean(f, draws=0)
    with pytest.raises(ConfigError, match=r"\[n, 4\]"):
        r.posterior_mean(torch.zeros(2, 5))
    # an eps-prediction network is refused: x_0 would be (x_T - sqrt(1 - abar) eps) / sqrt(abar_T) at abar_T ~ 0
    eps = Reconstructor(tiny_config(prediction_type="epsilon"), seed=0)
    with pytest.raises(ConfigError, match="needs prediction_type 'v_prediction', got 'epsilon'.*sqrt"):
        eps.posterior_mean(f)


def test_device_and_precision_are_explicit():
    assert resolve_device("cpu").type == "cpu" and resolve_precision("auto", torch.device("cpu")) is None
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_precision("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ConfigError, match="precision 'fp16' needs a CUDA device"):
        resolve_precision("fp16", torch.device("cpu"))
    with pytest.raises(ConfigError, match="device must be one of auto, cpu, cuda, cuda:N, got 'gpu'"):
        resolve_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="device 'cuda': no CUDA device is visible"):
            resolve_device("cuda")
    r = Reconstructor(tiny_config(), precision="bf16", seed=0)   # bfloat16 autocast trains and samples on the CPU
    assert r.precision_name == "bfloat16 autocast"
    features, images = tiny_data()
    r.fit(features, images, steps=2, progress=False)
    assert all(p.dtype == torch.float32 for p in r.model.parameters())   # weights stay float32
    assert r.sample(features[:2], num_inference_steps=2).dtype == torch.float32


def test_sampling_settings_are_chosen_on_held_out_pairs():
    class Stub:
        """Reconstructs image i exactly at w = 3 and worse the further w is from 3; an init adds nothing."""

        def __init__(self, images):
            self.images = images
            self.seen = []

        def sample(self, features, *, settings, generator, progress=False, init=None):
            self.seen.append((generator.initial_seed(), init is not None))
            noise = torch.rand(self.images.shape, generator=torch.Generator().manual_seed(1)) - 0.5
            return (self.images + abs(settings.guidance_scale - 3.0) * 0.3 * noise).clamp(0, 1)

    images = torch.as_tensor(_blocks(), dtype=torch.float32)
    stub = Stub(images)
    candidates = [SamplingSettings(guidance_scale=w) for w in (1.0, 3.0, 5.0, 2.0)]
    best, scores = select_sampling(stub, torch.zeros(4, 2), images, candidates, seed=5)
    assert best.guidance_scale == 3.0 and scores[1]["ssim"] == pytest.approx(1.0) and scores[1]["psnr"] == 100.0
    assert scores[0]["ssim"] == pytest.approx(scores[2]["ssim"]) and scores[3]["ssim"] > scores[0]["ssim"]
    assert [seed for seed, _ in stub.seen] == [5, 5, 5, 5]  # the same starting noise for every candidate
    tied, _ = select_sampling(stub, torch.zeros(4, 2), images, [candidates[2], candidates[0]])
    assert tied.guidance_scale == 5.0   # ties go to the earlier candidate
    with pytest.raises(ConfigError, match="needs the decoder's estimates"):
        select_sampling(stub, torch.zeros(4, 2), images, [SamplingSettings(init_strength=0.5)])


def test_one_step_guidance_is_chosen_on_held_out_pairs_by_psnr():
    class Stub:
        """The one-step estimate of image i: exact at w = 1.25, off by |w - 1.25| * 0.4 * noise elsewhere."""

        def __init__(self, images):
            self.images, self.seen = images, []

        def posterior_mean(self, features, *, draws, guidance_scale, generator, guide=None):
            self.seen.append((draws, guidance_scale, generator.initial_seed(), guide is not None))
            noise = torch.rand(self.images.shape, generator=torch.Generator().manual_seed(1)) - 0.5
            return (self.images + abs(guidance_scale - 1.25) * 0.4 * noise).clamp(0, 1)

    images = torch.as_tensor(_blocks(), dtype=torch.float32)
    stub = Stub(images)
    best, scores = select_one_step_guidance(stub, torch.zeros(4, 2), images, (1.0, 1.25, 1.5, 1.1), draws=6,
                                            seed=5, guide=images)
    assert best == 1.25 and [s["guidance_scale"] for s in scores] == [1.0, 1.25, 1.5, 1.1]
    assert scores[1]["psnr"] == 100.0 and scores[1]["ssim"] == pytest.approx(1.0)
    off = stub.posterior_mean(torch.zeros(4, 2), draws=6, guidance_scale=1.0, generator=torch.Generator())
    assert scores[0]["psnr"] == pytest.approx(float(np.mean(psnr_pairs(images, off))))
    assert scores[0]["psnr"] == pytest.approx(scores[2]["psnr"]) and scores[3]["psnr"] > scores[0]["psnr"]
    assert stub.seen[:4] == [(6, w, 5, True) for w in (1.0, 1.25, 1.5, 1.1)]   # the same draws for every scale
    tied, _ = select_one_step_guidance(stub, torch.zeros(4, 2), images, [1.5, 1.0], draws=2)
    assert tied == 1.5   # ties go to the earlier scale
    with pytest.raises(ConfigError, match="guidance scale must be a number in"):
        select_one_step_guidance(stub, torch.zeros(4, 2), images, [1.0, -1.0], draws=2)
    with pytest.raises(ConfigError, match="one or more guidance scales"):
        select_one_step_guidance(stub, torch.zeros(4, 2), images, [], draws=2)


# -- selections -----------------------------------------------------------------------------------------------------

def test_top_selection_sizes_and_order():
    assert [top_count(n, 0.01) for n in (1, 99, 100, 101, 450, 9000)] == [1, 1, 1, 2, 5, 90]
    assert top_count(0, 0.01) == 0
    assert top_indices([0.1, 0.9, 0.5, 0.9], 0.5).tolist() == [1, 3]
    with pytest.raises(ConfigError, match="fraction"):
        top_indices([0.1], 0.0)


def _blocks() -> np.ndarray:
    """Four distinct 16 x 16 images: a bright quadrant each."""
    images = np.zeros((4, 1, 16, 16))
    for i, (r, c) in enumerate([(0, 0), (0, 8), (8, 0), (8, 8)]):
        images[i, 0, r:r + 8, c:c + 8] = 1.0
    return images


def test_agreement_picks_the_consistent_feature_and_its_medoid():
    q = _blocks()
    samples = np.stack([
        np.stack([q[0], q[1], q[2]]),  # three different images: low agreement
        np.stack([q[3], q[3], q[3]]),  # identical samples: agreement 1
        np.stack([q[0], q[2], q[0]]),  # two agree: the medoid is one of them (the first)
    ])
    agreement, medoid = agreement_scores(samples)
    assert agreement[1] == pytest.approx(1.0, abs=1e-12)
    assert agreement[1] > agreement[2] > agreement[0]
    assert medoid.tolist()[1:] == [0, 0]
    assert top_indices(agreement, 0.34).tolist() == [1, 2]


def test_nearest_and_near_duplicate_filter_remove_an_exact_copy():
    q = _blocks()
    rng = np.random.default_rng(0)
    attacker = np.concatenate([q, rng.random((6, 1, 16, 16))])
    index, best = nearest(q[[2, 0]], attacker)
    assert index.tolist() == [2, 0] and np.allclose(best, 1.0)
    noisy = np.clip(attacker + 0.2 * rng.random(attacker.shape), 0, 1)
    exact, exact_best = nearest(noisy, attacker)
    fast, fast_best = nearest(noisy, attacker, fast=True)   # float32 search, float64 rescore of the winners
    assert fast.tolist() == exact.tolist() and np.array_equal(fast_best, exact_best)
    defender = np.concatenate([rng.random((3, 1, 16, 16)), attacker[7:8], rng.random((2, 1, 16, 16))])
    kept, max_ssim = near_duplicate_filter(defender, attacker, fraction=0.0, threshold=None)
    assert kept.tolist() == [0, 1, 2, 4, 5] and max_ssim[3] == pytest.approx(1.0)
    kept, _ = near_duplicate_filter(defender, attacker, fraction=0.2)  # top 20 % of 6 = 2 images
    assert len(kept) == 4 and 3 not in kept.tolist()


class StubReconstructor:
    """Returns, for feature (i, amount, jitter), target i plus ``amount`` * fixed noise plus ``jitter`` * fresh noise
    (so every selection is predictable)."""

    def __init__(self, targets: torch.Tensor) -> None:
        self.targets = targets
        self.noise = torch.rand(targets.shape, generator=torch.Generator().manual_seed(0)) - 0.5

    def sample(self, features, *, generator, settings=None, progress=False, init=None):
        i = features[:, 0].long()
        amount = features[:, 1].view(-1, 1, 1, 1)
        jitter = features[:, 2].view(-1, 1, 1, 1) * torch.randn(len(features), 1, 16, 16, generator=generator)
        return (self.targets[i] + amount * self.noise[i] + jitter).clamp(0, 1)

    def posterior_mean(self, features, *, draws, generator, guide=None, guidance_scale=1.0):
        """The samples' expectation before clamping (no jitter), recording the draws and the scale asked for."""
        self.draws, self.guidance_scale = draws, guidance_scale
        i = features[:, 0].long()
        return (self.targets[i] + features[:, 1].view(-1, 1, 1, 1) * self.noise[i]).clamp(0, 1)


@pytest.fixture(scope="module")
def lpips_metric():
    return LPIPS()


def _rows(result, fractions=(0.25,)):
    rows = rows_from_scores(result.scored, top_fractions=fractions, n_boot=200)
    return {(r.estimate, r.level, r.selection, r.top): r for r in rows}


def test_raw_rows_score_medoids_and_means_and_say_which_use_ground_truth(lpips_metric):
    targets = torch.as_tensor(_blocks(), dtype=torch.float32)
    # target 2 is reconstructed exactly, every time; the others with growing error and sample-to-sample jitter.
    features = torch.tensor([[0, 0.6, 0.3], [1, 0.9, 0.3], [2, 0.0, 0.0], [3, 0.3, 0.3]])
    release = Release("raw", features, torch.arange(4), set_level=False, epsilon=math.inf)
    stub = StubReconstructor(targets)
    result = evaluate_release(release, stub, targets, lpips=lpips_metric, samples_per_feature=3, one_step_draws=2)
    rows = _rows(result)
    medoid = {k[1:]: r for k, r in rows.items() if k[0] == "medoid of 3"}
    assert set(medoid) == {("per-feature", "all", "all"), ("per-feature", "attacker", "25%"),
                           ("per-feature", "oracle", "25%"), ("set-level", "all", "all"),
                           ("set-level", "attacker", "25%"), ("set-level", "oracle", "25%")}
    assert {k[0] for k in rows} == {"medoid of 3", "mean of 3", "one-step mean of 2"} and stub.draws == 2
    assert stub.guidance_scale == 1.0
    truth = {k: r.ground_truth for k, r in medoid.items()}
    assert truth[("per-feature", "all", "all")] == "none" and truth[("per-feature", "attacker", "25%")] == "none"
    assert truth[("per-feature", "oracle", "25%")] == "selection"
    assert truth[("set-level", "all", "all")] == "matching" and truth[("set-level", "attacker", "25%")] == "matching"
    assert truth[("set-level", "oracle", "25%")] == "matching+selection"
    # n counts scored pairs the same way everywhere: all = 4, a top 25 % = ceil(0.25 * 4) = 1.
    assert [medoid[k].n for k in sorted(medoid)] == [4, 1, 1, 4, 1, 1]
    oracle, attacker = medoid[("per-feature", "oracle", "25%")], medoid[("per-feature", "attacker", "25%")]
    assert oracle.ssim == pytest.approx(1.0) and oracle.psnr == 100.0 and oracle.lpips == pytest.approx(0, abs=1e-6)
    assert attacker.ssim == pytest.approx(1.0)  # agreement 1 only for the noise-free feature
    # the interval redoes the selection in every resample: a resample without the exact copy picks a worse image
    assert oracle.ssim_high == pytest.approx(1.0) and oracle.ssim_low < 0.99 and oracle.seed == "0"
    everything = medoid[("per-feature", "all", "all")]
    assert everything.ssim < 0.99 and everything.ssim_low < everything.ssim < everything.ssim_high
    # the per-feature reconstruction is the medoid of the samples, and the mean their average: recompute both
    samples = StubReconstructor(targets).sample(features.repeat_interleave(3, 0),
                                                generator=torch.Generator().manual_seed(0)).reshape(4, 3, 1, 16, 16)
    _, index = agreement_scores(samples.numpy())
    medoids = samples[torch.arange(4), torch.as_tensor(index)]
    assert torch.equal(result.reconstructions["medoid of 3"], medoids) and torch.equal(result.shown["medoid of 3"],
                                                                                       medoids)
    assert torch.allclose(result.reconstructions["mean of 3"], samples.mean(1))
    assert everything.ssim == pytest.approx(float(ssim_pairs(targets, medoids).mean()))
    mean_row = rows[("mean of 3", "per-feature", "all", "all")]
    assert mean_row.ssim == pytest.approx(float(ssim_pairs(targets, samples.mean(1)).mean()))
    one_step = stub.posterior_mean(features, draws=2, generator=None)
    assert torch.equal(result.reconstructions["one-step mean of 2"], one_step)
    assert rows[("one-step mean of 2", "per-feature", "all", "all")].ssim == pytest.approx(
        float(ssim_pairs(targets, one_step).mean()))
    without = evaluate_release(release, stub, targets, lpips=lpips_metric, samples_per_feature=2, one_step_draws=0)
    assert set(without.reconstructions) == {"medoid of 2", "mean of 2"}   # 0: not scored
    guided = evaluate_release(release, stub, targets, lpips=lpips_metric, samples_per_feature=2, one_step_draws=2,
                              one_step_guidance=1.25)
    assert "one-step mean of 2, w 1.25" in guided.reconstructions and stub.guidance_scale == 1.25
    with pytest.raises(ConfigError, match="one_step_draws must be an integer >= 0 .*got -1"):
        evaluate_release(release, stub, targets, lpips=lpips_metric, one_step_draws=-1)
    # set-level all can only match better than per-feature all (each target may pick any reconstruction)
    assert medoid[("set-level", "all", "all")].ssim >= everything.ssim - 1e-12
    # the per-image scores behind the rows
    per_feature = next(s for s in result.scored if s.level == "per-feature" and s.estimate == "medoid of 3")
    assert per_feature.index.tolist() == [0, 1, 2, 3] and per_feature.matched.tolist() == [0, 1, 2, 3]
    assert len(per_feature.records()) == 4 and per_feature.records()[2]["ssim"] == pytest.approx(1.0)


def test_set_level_matches_each_target_to_its_closest_reconstruction(lpips_metric):
    targets = torch.as_tensor(_blocks(), dtype=torch.float32)
    # The reconstruction set holds an exact copy of target 1 and noisy versions of target 3 only.
    features = torch.tensor([[1, 0.0, 0.0], [3, 0.8, 0.2], [3, 0.9, 0.0]])
    release = Release("fedpft", features, torch.zeros(3, dtype=torch.long), set_level=True, epsilon=math.inf)
    result = evaluate_release(release, StubReconstructor(targets), targets, lpips=lpips_metric,
                              samples_per_feature=2)
    rows = {k[1:]: r for k, r in _rows(result).items() if k[0] == "medoid of 2"}
    assert not any(level == "per-feature" for level, _, _ in rows)
    assert rows[("set-level", "oracle", "25%")].ssim == pytest.approx(1.0)
    assert rows[("set-level", "oracle", "25%")].set_size == 3
    assert torch.equal(result.shown["medoid of 2"][1], targets[1])
    assert rows[("set-level", "all", "all")].n == 4 and rows[("set-level", "all", "all")].ssim < 0.9
    # the attacker's most confident reconstruction is the exact copy (its two samples agree), paired with target 1;
    # its top 25 % is of the 3 reconstructions: 1
    attacker = rows[("set-level", "attacker", "25%")]
    assert attacker.n == 1 and attacker.ssim == pytest.approx(1.0)
    scored, matched = nearest_image_baseline(targets[:2], targets, lpips=lpips_metric)
    baseline = rows_from_scores(scored, top_fractions=(0.5,), n_boot=100)
    assert [(r.selection, r.ground_truth) for r in baseline] == [("all", "matching"),
                                                                 ("oracle", "matching+selection")]
    assert baseline[0].ssim == pytest.approx(1.0) and baseline[0].attack == "nearest image by SSIM"
    assert isinstance(baseline[0], AttackRow) and torch.equal(matched, targets[:2])


def test_a_raw_release_of_every_image_scores_the_kept_targets_against_their_own_features(lpips_metric):
    q = torch.as_tensor(_blocks(), dtype=torch.float32)
    reconstructions = q[[3, 0, 1, 2]]         # release order: feature j is of image (j + 3) mod 4
    kept = np.array([1, 2])                    # targets q[0] and q[1] (images 2 and 3 were filtered out)
    sets, shown = score_reconstructions(q[:2], reconstructions, np.arange(4.0), linked=kept, lpips=lpips_metric,
                                        seed=1, source="raw", epsilon=math.inf, attack="x")
    per_feature, targets, recons = sets
    assert (per_feature.level, targets.unit, recons.unit) == ("per-feature", "target", "reconstruction")
    assert np.allclose(per_feature.ssim, 1.0) and per_feature.matched.tolist() == [1, 2]
    assert per_feature.confidence.tolist() == [1.0, 2.0] and torch.equal(shown, q[:2])
    assert recons.set_size == 4 and len(recons.index) == 4   # the whole released set is the set-level candidates
    with pytest.raises(ConfigError, match="one reconstruction index"):
        score_reconstructions(q[:2], reconstructions, np.arange(4.0), linked=np.array([0, 9]), lpips=lpips_metric,
                              seed=1, source="raw", epsilon=math.inf, attack="x")


def test_rows_pool_the_seeds_and_select_within_each():
    def scored(seed, ssim, confidence):
        n = len(ssim)
        return ScoredSet(seed, "raw", math.inf, "x", "-", "per-feature", "target", n, np.arange(n), np.arange(n),
                         np.full(n, 20.0), np.zeros(n), np.asarray(ssim, float), np.asarray(confidence, float))

    sets = [scored(0, [0.1, 0.2, 0.3, 0.9], [4, 3, 2, 1]), scored(1, [0.5, 0.6, 0.7, 0.8], [1, 2, 3, 4])]
    rows = {(r.selection, r.seed): r for r in rows_from_scores(sets, top_fractions=(0.5,), n_boot=300)}
    assert set(rows) == {(s, seed) for s in ("all", "attacker", "oracle") for seed in ("0", "1", "all")}
    assert rows[("all", "all")].ssim == pytest.approx(0.5125) and rows[("all", "all")].n == 8
    assert rows[("oracle", "0")].ssim == pytest.approx(0.6) and rows[("oracle", "1")].ssim == pytest.approx(0.75)
    assert rows[("oracle", "all")].ssim == pytest.approx(0.675) and rows[("oracle", "all")].n == 4
    assert rows[("attacker", "0")].ssim == pytest.approx(0.15)   # its two most confident are its two worst
    assert rows[("attacker", "all")].ssim == pytest.approx((0.15 + 0.75) / 2)
    assert rows[("all", "0")].psnr_low == rows[("all", "0")].psnr_high == 20.0


def test_decoders_are_scored_on_the_same_sets(lpips_metric):
    from attacks.decoders import KNNDecoder

    targets = torch.as_tensor(_blocks(), dtype=torch.float32)
    attacker_images = torch.flip(targets, dims=(0,))  # attacker image j = target 3 - j
    attacker_features = torch.eye(4)
    decoder = KNNDecoder(ks=(1,), name="nn").fit(attacker_features, attacker_images, torch.arange(4),
                                                 attacker_features, attacker_images, torch.arange(4))
    # released features: target i's feature is near attacker feature 3 - i, with decreasing clarity
    released = torch.eye(4)[[3, 2, 1, 0]] + torch.tensor([0.0, 0.3, 0.6, 0.9])[:, None]
    release = Release("raw", released, torch.arange(4), set_level=False, epsilon=math.inf)
    result = evaluate_decoder(release, decoder, targets, lpips=lpips_metric, attacker_features=attacker_features)
    assert torch.equal(result.reconstructions["-"], targets)
    rows = {k[1:]: r for k, r in _rows(result).items()}
    assert all(r.attack == "nn" and r.estimate == "-" for r in rows.values())
    assert rows[("per-feature", "all", "all")].ssim == pytest.approx(1.0)
    # the attacker's confidence is each feature's best cosine similarity to its own: highest for the clearest
    per_feature = next(s for s in result.scored if s.level == "per-feature")
    assert per_feature.confidence[0] == pytest.approx(1.0) and np.all(np.diff(per_feature.confidence) < 0)


# -- schemes --------------------------------------------------------------------------------------------------------

def _unit_data(n: int = 60, d: int = 6, classes: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % classes
    centres = torch.rand(classes, d, generator=g) * 2
    features = (centres[labels] + 0.1 * torch.rand(n, d, generator=g)).clamp_min(0)
    return features / features.norm(dim=1, keepdim=True), labels


def test_releases_go_through_the_client_and_the_ledger():
    features, labels = _unit_data()
    raw = make_release("raw", features, labels, num_classes=3)
    assert not raw.set_level and torch.equal(raw.features, features) and raw.epsilon == math.inf
    assert raw.details["ledger"]["purpose"] == "raw_features" and raw.details["bytes"] == 60 * 6 * 4 + 60 * 8
    fedpft = make_release("fedpft", features, labels, num_classes=3, components=2)
    assert fedpft.set_level and fedpft.features.shape == (60, 6) and fedpft.details["set_size"] == 60
    assert fedpft.epsilon == math.inf and fedpft.details["ledger"]["purpose"] == "gmm"
    assert fedpft.details["bytes"] == payload_bytes(6, 2, 3, "diag")  # float16 on the wire, as FedPFT sends it
    assert torch.allclose(fedpft.features.norm(dim=1), torch.ones(60), atol=1e-5)
    assert sorted(torch.bincount(fedpft.labels).tolist()) == [20, 20, 20]
    dp1 = make_release("dp-fedpft", features, labels, num_classes=3, epsilon=1.0, delta=1e-5)
    dp8 = make_release("dp-fedpft", features, labels, num_classes=3, epsilon=8.0, delta=1e-5)
    ledger = dp1.details["ledger"]
    assert ledger["purpose"] == "dp_gmm" and ledger["metadata"]["noise"] == "seeded"
    # the epsilon is the accountant's for the recorded event, not the requested one
    assert dp1.epsilon == pytest.approx(accountant_epsilon(event_from_dict(ledger["event"]), 1e-5), rel=1e-12)
    assert dp1.details["requested_epsilon"] == 1.0 and 0 < dp1.epsilon <= 1.0 + 1e-9
    assert dp1.epsilon < dp8.epsilon and dp1.label == "dp-fedpft, naive"
    assert ledger["metadata"]["sigmas"]["sum"] > 4 * dp8.details["ledger"]["metadata"]["sigmas"]["sum"]
    assert dp1.details["bytes"] == payload_bytes(6, 1, 3, "diag")
    # seeded noise: the same seed gives the same release, another seed another one
    again = make_release("dp-fedpft", features, labels, num_classes=3, epsilon=1.0, delta=1e-5)
    other = make_release("dp-fedpft", features, labels, num_classes=3, epsilon=1.0, delta=1e-5, seed=1)
    assert torch.equal(again.features, dp1.features) and not torch.equal(other.features, dp1.features)
    with pytest.raises(ConfigError, match="valid schemes: raw, fedpft, dp-fedpft"):
        make_release("gan", features, labels, num_classes=3)
    with pytest.raises(ConfigError, match="epsilon is required"):
        make_release("dp-fedpft", features, labels, num_classes=3)
    with pytest.raises(ConfigError, match="dp_noise"):
        make_release("dp-fedpft", features, labels, num_classes=3, epsilon=1.0, dp_noise="weak")


def test_postprocessing_is_the_lmmse_of_the_class_moments():
    features, labels = _unit_data(n=90)
    prior = AttackerPrior.fit(features, labels, num_classes=3)
    release = make_release("dp-fedpft", features[:60], labels[:60], num_classes=3, epsilon=2.0, delta=1e-5)
    post = postprocess_release(release, prior, seed=0)
    assert post.label == "dp-fedpft, post-processed" and post.epsilon == release.epsilon
    sigmas = release.details["ledger"]["metadata"]["sigmas"]
    for delivered, estimate in zip(release.mixtures, post.mixtures):
        c, n_c = delivered.label, delivered.count
        mu, var = prior.class_means[c], prior.class_variances[c]
        m = torch.as_tensor(delivered.means[0], dtype=torch.float64)
        s2 = (sigmas["sum"] / n_c) ** 2
        if float(m.norm()) >= 1 - 2e-3:  # the release clipped its mean to the unit ball
            m = m * math.sqrt(float(mu @ mu) + 6 * s2) / float(m.norm())
        w = (var / n_c) / (var / n_c + s2)
        assert torch.allclose(torch.as_tensor(estimate.means[0]), mu + w * (m - mu), atol=1e-12)
        v = torch.as_tensor(delivered.covariances[0], dtype=torch.float64)
        q, r = 2 * var * var / n_c, (sigmas["second_moment_sum"] / n_c) ** 2
        expected = (var + q / (q + r) * (v - var)).clamp_min(1e-6)
        assert torch.allclose(torch.as_tensor(estimate.covariances[0]), expected, atol=1e-12)
    assert (post.features >= 0).all() and torch.allclose(post.features.norm(dim=1), torch.ones(60), atol=1e-5)
    assert 0 < post.details["postprocessing"]["mean_release_weight"] < 0.5  # the noise outweighs the signal
    before, after = feature_diagnostics(release.features, prior), feature_diagnostics(post.features, prior)
    assert before["standardised_rms"] > 2 * after["standardised_rms"] and after["standardised_rms"] < 1.5
    assert before["negative_fraction"] > 0.1 and after["negative_fraction"] == 0
    # FedPFT has no noise: its mixtures stay, only the draws are clipped at 0 and renormalised
    fedpft = make_release("fedpft", features[:60], labels[:60], num_classes=3, components=2)
    clipped = postprocess_release(fedpft, prior)
    assert clipped.mixtures == fedpft.mixtures and clipped.label == "fedpft, post-processed"
    assert torch.allclose(clipped.features, fedpft.features.clamp_min(0) / fedpft.features.clamp_min(0).norm(
        dim=1, keepdim=True), atol=1e-6)
    with pytest.raises(ConfigError, match="mixture releases"):
        postprocess_release(make_release("raw", features, labels, num_classes=3), prior)
    sparse = AttackerPrior.fit(features[:5], labels[:5], num_classes=3)  # one feature of class 2
    assert sparse.class_counts.tolist() == [2, 2, 1] and torch.isnan(sparse.class_means[2]).all()
    with pytest.raises(ConfigError, match="class 2, of which the attacker's prior holds 1 features"):
        postprocess_release(release, sparse)



def test_spherical_postprocessing_derives_the_variance_from_the_estimated_mean():
    # Spherical on the sphere releases no second moment: the released variance (1 - ||m||^2)/d comes from the noisy
    # mean, and at epsilon 1 the mean is clipped to norm 1, so the release says "variance 0" (the floor). Trusting it
    # collapsed every drawn feature of a class onto its mean.
    features, labels = _unit_data(n=90)
    prior = AttackerPrior.fit(features, labels, num_classes=3)
    release = make_release("dp-fedpft", features[:60], labels[:60], num_classes=3, epsilon=1.0, delta=1e-5,
                           covariance="spherical")
    assert release.details["ledger"]["metadata"]["sigmas"]["second_moment_sum"] == 0.0
    post = postprocess_release(release, prior, seed=0)
    clipped = 0
    for delivered, estimate in zip(release.mixtures, post.mixtures):
        mean = torch.as_tensor(estimate.means[0], dtype=torch.float64)
        expected = max((1.0 - float(mean @ mean)) / 6, 1e-6)
        assert float(estimate.covariances[0]) == pytest.approx(expected, rel=1e-12)
        if float(torch.as_tensor(delivered.means[0]).norm()) >= 1 - 2e-3:     # clipped: released at the floor
            clipped += 1
            assert float(delivered.covariances[0]) < 1e-5 < expected
    assert clipped >= 1
    assert post.details["postprocessing"]["variance_release_weight"] == 0.0
    # the drawn features of a class spread like the class, not onto one point
    spread = [float(torch.pdist(post.features[post.labels == c]).mean()) for c in range(3)]
    truth = [float(torch.pdist(features[:60][labels[:60] == c]).mean()) for c in range(3)]
    assert all(s > 0.3 * t for s, t in zip(spread, truth))

def test_full_covariance_postprocessing_weighs_the_release_along_the_class_directions():
    features, labels = _unit_data(n=90)
    diag = AttackerPrior.fit(features, labels, num_classes=3)
    full = AttackerPrior.fit(features, labels, num_classes=3, full_covariance=True)
    assert diag.class_eigenvectors is None and full.class_eigenvalues.shape == (3, 6)
    release = make_release("dp-fedpft", features[:60], labels[:60], num_classes=3, epsilon=8.0, delta=1e-5)
    post = postprocess_release(release, full, seed=0)
    sigma = release.details["ledger"]["metadata"]["sigmas"]["sum"]
    for delivered, estimate in zip(release.mixtures, post.mixtures):
        c, n_c = delivered.label, delivered.count
        x = features[:90][labels[:90] == c].double()
        covariance = (x - x.mean(0)).T @ (x - x.mean(0)) / len(x)
        m = torch.as_tensor(delivered.means[0], dtype=torch.float64)
        if float(m.norm()) >= 1 - 2e-3:
            m = m * math.sqrt(float(x.mean(0) @ x.mean(0)) + 6 * (sigma / n_c) ** 2) / float(m.norm())
        # the Gaussian posterior mean: mu + (S / n)(S / n + s^2 I)^-1 (m - mu)
        gain = covariance / n_c @ torch.linalg.inv(covariance / n_c + (sigma / n_c) ** 2 * torch.eye(6,
                                                                                                 dtype=torch.float64))
        assert torch.allclose(torch.as_tensor(estimate.means[0]), x.mean(0) + gain @ (m - x.mean(0)), atol=1e-9)
    info = post.details["postprocessing"]
    assert "full covariance" in info["method"] and info["top_direction_mean_weight"] > info["mean_release_weight"]
    assert postprocess_release(release, diag).details["postprocessing"]["mean_release_weight"] < \
        info["top_direction_mean_weight"]


def test_prior_only_ignores_the_release_but_its_counts():
    features, labels = _unit_data(n=90)
    prior = AttackerPrior.fit(features, labels, num_classes=3)
    low = make_release("dp-fedpft", features[:60], labels[:60], num_classes=3, epsilon=1.0, delta=1e-5)
    high = make_release("dp-fedpft", features[:60], labels[:60], num_classes=3, epsilon=10.0, delta=1e-5, seed=3)
    a, b = prior_only_release(low, prior, seed=4), prior_only_release(high, prior, seed=4)
    assert torch.equal(a.features, b.features) and a.label == "prior only (release ignored)" and a.epsilon == 0.0
    assert [m.count for m in a.mixtures] == [m.count for m in low.mixtures] == [20, 20, 20]
    for mixture in a.mixtures:
        assert np.allclose(mixture.means[0], prior.class_means[mixture.label].numpy())
    # the post-processed reading of the same draw differs only by the moments
    post = postprocess_release(high, prior, seed=4)
    assert post.features.shape == a.features.shape and not torch.equal(post.features, a.features)
    with pytest.raises(ConfigError, match="dp-fedpft releases"):
        prior_only_release(make_release("fedpft", features[:60], labels[:60], num_classes=3, components=2), prior)


# -- the command line -----------------------------------------------------------------------------------------------

def test_cli_rejects_bad_values_before_any_work(tmp_path, capsys):
    cases = [(["--schemes", "raw,gan"], "valid: raw, fedpft, dp-fedpft"), (["--schemes", "dp-fedpft", "--eps", "0"],
                                                                           "--eps"),
             (["--image-size", "8"], "--image-size"), (["--covariance", "banana"], "full, diag or spherical"),
             (["--guidance", "1,-2"], "--guidance"), (["--validation-images", "0"], "--validation-images"),
             (["--dp-noise", "weak"], "--dp-noise"), (["--readings", "raw"], "--readings must be one of post"),
             (["--baselines", "mlp,gan"], "unknown baseline(s) ['gan']"), (["--precision", "fp8"], "--precision"),
             (["--device", "tpu"], "device must be one of auto, cpu, cuda, cuda:N, got 'tpu'"),
             (["--seeds", "1,1"], "--seeds must be distinct"), (["--guidance-intervals", "0.9:0.1"],
                                                                "guidance_interval"),
             (["--one-step-draws", "-2"], "--one-step-draws must be an integer >= 0 (noise draws the one-step "
                                          "posterior mean averages; 0: not scored), got -2"),
             (["--prediction-type", "epsilon"], "--one-step-draws needs --prediction-type v_prediction"),
             (["--guide-decoder", "ridge"], "--guide-decoder must be knn, nn, mlp, mlp-tuned or none"),
             (["--guide-folds", "1"], "--guide-folds must be >= 2"),
             (["--init-weights", str(tmp_path / "none.pt")], "none.pt' is not a file")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA device is visible"))
    for extra, needle in cases:
        assert reconstruct_main(["--out", str(tmp_path)] + extra) == 2, extra
        assert needle in capsys.readouterr().err, extra
    assert not any(tmp_path.iterdir())   # nothing was written


def test_presets_and_help_show_what_runs(capsys):
    settings, _ = settings_from_args(["--out", "x", "--preset", "quick", "--steps", "7"])
    assert settings.steps == 7 and settings.attacker_images == PRESETS["quick"]["attacker_images"]
    assert settings.block_channels == (16, 32, 32) and settings.seeds == (0,)
    bench, _ = settings_from_args(["--out", "x", "--preset", "benchmark"])
    assert bench.seeds == (0, 1, 2) and bench.attacker_images is None and bench.eps == (1.0, 4.0, 10.0)
    assert bench.image_size == 28 and bench.layers_per_block == 2
    # the reduced preset evaluates the benchmark's reconstructor: same training pairs and model, so one checkpoint
    reduced, _ = settings_from_args(["--out", "x", "--preset", "reduced"])
    assert reconstructor_config(reduced, 1280, 1) == reconstructor_config(bench, 1280, 1)
    same = ("dataset", "backbone", "input_size", "attacker_images", "validation_images", "seed", "guide_decoder",
            "steps", "precision", "eps", "schemes", "seeds")
    assert [getattr(reduced, k) for k in same] == [getattr(bench, k) for k in same]
    assert reduced.defender_images == 250 < bench.defender_images and reduced.samples_per_feature == 4
    plain, _ = settings_from_args(["--out", "x", "--no-progress"])
    assert plain.progress is False and plain.steps == 8000 and plain.device == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "(default: 1,4,10)" in text and "(default: auto)" in text and "(default: all)" in text
    assert "quick: --attacker-images 2000" in text and "benchmark:" in text
    assert "one-step posterior mean (its x_0 prediction at t = T - 1" in " ".join(text.split())
    assert plain.one_step_draws == 8 and settings_from_args(["--out", "x", "--one-step-draws", "2"])[0] \
        .one_step_draws == 2
    assert plain.one_step_guidance == (1.0, 1.1, 1.25, 1.5) and "(default: 1,1.1,1.25,1.5)" in text
    assert settings_from_args(["--out", "x", "--one-step-guidance", "1,2"])[0].one_step_guidance == (1.0, 2.0)


def test_cli_end_to_end_on_tiny_data_reuses_its_checkpoint(tmp_path, monkeypatch, capsys):
    import csv
    import json

    import attacks.reconstruct_outputs as outputs

    monkeypatch.setenv("PRIVFL_CACHE_DIR", str(tmp_path / "cache"))  # backbone features cached here
    panels = []
    save_grid = outputs.save_grid
    monkeypatch.setattr(outputs, "save_grid", lambda path, shown, **k: (panels.append([n for n, _ in shown]),
                                                                         save_grid(path, shown, **k))[1])
    out = tmp_path / "run"
    argv = ["--out", str(out), "--dataset", "digits", "--input-size", "32", "--attacker-images", "100",
            "--validation-images", "10", "--defender-images", "20", "--seeds", "0,1", "--image-size", "16",
            "--block-channels", "8,16", "--layers-per-block", "1", "--condition-dims", "8", "--steps", "3",
            "--batch-size", "8", "--guidance", "1,2", "--guidance-rescales", "0", "--guidance-intervals", "0:1",
            "--init-strengths", "0.5", "--selection-images", "6", "--ddim-steps", "2", "--samples-per-feature", "2",
            "--set-samples-per-feature", "2", "--one-step-draws", "3", "--one-step-guidance", "1,1.5",
            "--mlp-hidden", "16", "--mlp-epochs", "2",
            "--top-fractions", "0.1",
            "--eps", "1,4", "--components", "2", "--checkpoint-every", "2", "--bootstrap", "100", "--device", "cpu",
            "--baselines", "mlp,nn,class-mean", "--prior-covariance", "diag", "--no-progress", "--threads", "1"]
    assert reconstruct_main(argv) == 0
    printed = capsys.readouterr().out
    assert "ground truth used" in printed and "3 steps" in printed and "device: cpu (float32)" in printed
    summary = json.loads((out / "attack_results.json").read_text())
    with open(out / "attack_results.csv", newline="") as stream:
        table = list(csv.DictReader(stream))
    with open(out / "per_image_scores.csv", newline="") as stream:
        scores = list(csv.DictReader(stream))
    assert len(table) == len(summary["rows"]) > 0 and summary["device"]["device"] == "cpu"
    assert (out / "attack_results.md").read_text().count("\n") == len(table) + 2
    for figure in ("attack_grid.png", "attack_metrics.png"):
        assert (out / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "reconstructor.pt").is_file()
    sources = {row["source"] for row in table}
    assert sources == {"raw", "fedpft, post-processed", "dp-fedpft, post-processed", "prior only (release ignored)",
                       "no release"}
    assert {row["attack"] for row in table} == {"diffusion", "mlp", "nn", "class-mean", "nearest image by SSIM"}
    # the one-step guidance scale with the best held-out PSNR, named in the estimate unless it is 1
    candidates = summary["sampling"]["one_step_candidates"]
    w = summary["sampling"]["one_step_guidance"]
    assert [c["guidance_scale"] for c in candidates] == [1.0, 1.5] and len(summary["sampling"]["guidance_candidates"])
    assert w == max(candidates, key=lambda c: c["psnr"])["guidance_scale"] and f"one-step w {w:g}" in printed
    named = "one-step mean of 3" + ("" if w == 1.0 else f", w {w:g}")
    assert {row["estimate"] for row in table if row["attack"] == "diffusion"} == {"medoid of 2", "mean of 2", named}
    # the one-step posterior mean is scored per image for raw and mixture releases alike
    one_step = {(s["source"], s["level"], s["unit"]) for s in scores if s["estimate"] == named}
    assert {("raw", "per-feature", "target"), ("raw", "set-level", "target"),
            ("fedpft, post-processed", "set-level", "target"), ("dp-fedpft, post-processed", "set-level", "target"),
            ("prior only (release ignored)", "set-level", "reconstruction")} <= one_step
    assert sum(1 for s in scores if (s["estimate"], s["source"], s["level"], s["seed"]) ==
               (named, "raw", "per-feature", "0")) == 18
    assert {row["seed"] for row in table} == {"0", "1", "all"}
    evaluated = [s["evaluated"] for s in summary["protocol"]["seeds"]]
    assert evaluated == [18, 18]  # 10 % of 20 removed as near-duplicates, per seed
    assert {int(row["n"]) for row in table if row["top"] == "all" and row["seed"] == "0"} == {18}
    assert {int(row["n"]) for row in table if row["top"] == "all" and row["seed"] == "all"} == {36}
    assert all(float(r["psnr_low"]) <= float(r["psnr"]) <= float(r["psnr_high"]) for r in table)
    # every release has the same defender set behind it: 20 released features per seed
    assert {r["features"] for r in summary["releases"]} == {20}
    dp = [r for r in summary["releases"] if r["scheme"] == "dp-fedpft" and r["source"] != "prior only (release "
                                                                                          "ignored)"]
    assert len(dp) == 4 and {r["requested_epsilon"] for r in dp} == {1.0, 4.0}
    assert {row["epsilon"] for row in table if row["source"].startswith("prior only")} == {"0.0"}
    # the per-image scores give back every "all" row's mean
    row = next(r for r in table if (r["source"], r["attack"], r["level"], r["selection"], r["seed"]) ==
               ("raw", "mlp", "per-feature", "all", "0"))
    mine = [float(s["ssim"]) for s in scores if (s["source"], s["attack"], s["level"], s["unit"], s["seed"]) ==
            ("raw", "mlp", "per-feature", "target", "0")]
    assert len(mine) == 18 and float(row["ssim"]) == pytest.approx(np.mean(mine))
    assert all(int(s["defender_image"]) >= 0 for s in scores)
    # the grid says which reconstructions were matched to the defender's images with ground truth
    (names,) = panels
    assert names[0] == "defender image" and any(n.startswith("raw: diffusion, medoid") for n in names)
    assert f"raw: diffusion, {named}" in names
    assert all(n.endswith("oracle-matched") for n in names if n.startswith(("fedpft", "dp-fedpft", "prior",
                                                                            "no release")))
    assert summary["sampling"]["guidance_candidates"] and summary["sampling"]["init_decoder"] == "knn"
    assert summary["guide_decoder"]["name"] == "knn" and summary["reconstructor"]["config"]["guide_image"]
    # A second call finds the checkpoint at the requested steps and trains nothing.
    training_loss = Reconstructor.training_loss
    monkeypatch.setattr(Reconstructor, "training_loss", lambda *a, **k: pytest.fail("trained again"))
    assert reconstruct_main(argv + ["--train-only"]) == 0
    again = json.loads((out / "attack_results.json").read_text())
    assert "rows" not in again and again["reconstructor"]["steps"] == 3
    assert again["reconstructor"]["train_seconds"] == summary["reconstructor"]["train_seconds"]
    assert summary["reconstructor"]["exported"] is False
    # Trained elsewhere: its exported weights are evaluated as they are, and say so; more steps are refused.
    weights = Reconstructor.load(out / "reconstructor.pt").export(tmp_path / "weights.pt")
    elsewhere = argv + ["--checkpoint", str(weights), "--train-only"]
    assert reconstruct_main(elsewhere) == 0
    exported = json.loads((out / "attack_results.json").read_text())["reconstructor"]
    assert exported["exported"] is True and exported["steps"] == 3
    # named exactly: the same weights as trained, the file as read, and the command that trained them
    made_by = "privfl attack reconstruct " + " ".join(argv)
    assert exported["weights_sha256"] == summary["reconstructor"]["weights_sha256"]
    assert exported["made_by"] == summary["reconstructor"]["made_by"] == made_by
    assert exported["checkpoint_sha256"] == file_sha256(weights) and summary["command"] == made_by
    capsys.readouterr()
    assert reconstruct_main([*elsewhere, "--steps", "4"]) == 2
    assert "cannot train on to 4 steps; ask for steps=3" in capsys.readouterr().err
    # Fine-tuned from those weights, reading the cross-fitted MLP's estimates instead of the kNN average's.
    monkeypatch.setattr(Reconstructor, "training_loss", training_loss)
    tuned = argv + ["--guide-decoder", "mlp", "--guide-folds", "2", "--init-weights", str(weights), "--checkpoint",
                    str(tmp_path / "tuned.pt"), "--steps", "2", "--train-only"]
    assert reconstruct_main(tuned) == 0
    rec = json.loads((out / "attack_results.json").read_text())["reconstructor"]
    assert rec["steps"] == 2 and rec["initialised_from"]["step"] == 3
    assert rec["initialised_from"]["file"] == "weights.pt" and rec["initialised_from"]["fingerprint"]
    assert rec["initialised_from"]["made_by"] == made_by and rec["made_by"].endswith(" ".join(tuned))

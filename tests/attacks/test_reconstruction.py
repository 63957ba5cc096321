"""The diffusion reconstructor, the release schemes, the selections and the attack CLI's validation."""

from __future__ import annotations

import math
import sys
from pathlib import Path

# `.venv/bin/pytest` (unlike `python -m pytest`) does not put the repository root on sys.path, and the test folder
# tests/accounting then shadows the `accounting` package as a namespace package; make the real one win.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from attacks.metrics import LPIPS  # noqa: E402
from attacks.reconstruct_cli import reconstruct_main  # noqa: E402
from attacks.reconstructor import Reconstructor, ReconstructorConfig, train_or_resume  # noqa: E402
from attacks.schemes import AttackRow, Release, evaluate_release, make_release, nearest_image_baseline  # noqa: E402
from attacks.selection import agreement_scores, near_duplicate_filter, nearest, top_count, top_indices  # noqa: E402
from privfl.errors import ConfigError  # noqa: E402

torch.set_num_threads(1)


def tiny_config(**overrides) -> ReconstructorConfig:
    values = dict(feature_dim=4, image_size=16, channels=1, block_channels=(8, 16), norm_groups=4, batch_size=16,
                  learning_rate=2e-3, train_timesteps=100)
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


def test_config_errors_name_the_value():
    with pytest.raises(ConfigError, match="norm_groups=3"):
        tiny_config(norm_groups=3)
    with pytest.raises(ConfigError, match="cond_dropout"):
        tiny_config(cond_dropout=1.5)
    with pytest.raises(ConfigError, match="beta_schedule"):
        tiny_config(beta_schedule="cubic")
    r = Reconstructor(tiny_config(), seed=0)
    with pytest.raises(ConfigError, match=r"\[n, 4\]"):
        r.sample(torch.zeros(2, 5))
    with pytest.raises(ConfigError, match="guidance_scale"):
        r.sample(torch.zeros(2, 4), guidance_scale=-1)


def test_default_size_is_cpu_sized():
    r = Reconstructor(ReconstructorConfig(feature_dim=1280, image_size=28), seed=0)
    assert 1_000_000 < r.num_parameters < 5_000_000


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
    defender = np.concatenate([rng.random((3, 1, 16, 16)), attacker[7:8], rng.random((2, 1, 16, 16))])
    kept, max_ssim = near_duplicate_filter(defender, attacker, fraction=0.0, threshold=None)
    assert kept.tolist() == [0, 1, 2, 4, 5] and max_ssim[3] == pytest.approx(1.0)
    kept, _ = near_duplicate_filter(defender, attacker, fraction=0.2)  # top 20 % of 6 = 2 images
    assert len(kept) == 4 and 3 not in kept.tolist()


class StubReconstructor:
    """Returns, for feature (i, noise), target i plus ``noise`` * fixed noise (so every selection is predictable)."""

    def __init__(self, targets: torch.Tensor) -> None:
        self.targets = targets
        self.noise = torch.rand(targets.shape, generator=torch.Generator().manual_seed(0)) - 0.5

    def sample(self, features, *, guidance_scale, num_inference_steps, generator, progress=False):
        i = features[:, 0].long()
        amount = features[:, 1].view(-1, 1, 1, 1)
        jitter = features[:, 2].view(-1, 1, 1, 1) * torch.randn(len(features), 1, 16, 16, generator=generator)
        return (self.targets[i] + amount * self.noise[i] + jitter).clamp(0, 1)


@pytest.fixture(scope="module")
def lpips_metric():
    return LPIPS()


def test_raw_selections_pick_the_right_items(lpips_metric):
    targets = torch.as_tensor(_blocks(), dtype=torch.float32)
    # target 2 is reconstructed exactly, every time; the others with growing error and sample-to-sample jitter.
    features = torch.tensor([[0, 0.6, 0.3], [1, 0.9, 0.3], [2, 0.0, 0.0], [3, 0.3, 0.3]])
    release = Release("raw", features, torch.arange(4), set_level=False, epsilon=math.inf)
    result = evaluate_release(release, StubReconstructor(targets), targets, lpips=lpips_metric,
                              samples_per_feature=3, top_fractions=(0.25,))
    rows = {(r.selection, r.top): r for r in result.rows}
    assert set(rows) == {("all", "all"), ("attacker", "25%"), ("oracle", "25%")}
    oracle, attacker = rows[("oracle", "25%")], rows[("attacker", "25%")]
    assert oracle.n == 1 and oracle.ssim == pytest.approx(1.0) and oracle.psnr == 100.0
    assert oracle.lpips == pytest.approx(0.0, abs=1e-6)
    assert attacker.n == 1 and attacker.ssim == pytest.approx(1.0)  # agreement 1 only for the noise-free feature
    assert rows[("all", "all")].n == 4 and rows[("all", "all")].ssim < 0.99
    assert torch.equal(result.matched[2], targets[2])


def test_set_level_matches_each_target_to_its_closest_reconstruction(lpips_metric):
    targets = torch.as_tensor(_blocks(), dtype=torch.float32)
    # The reconstruction set holds an exact copy of target 1 and a noisy version of target 3 only.
    features = torch.tensor([[1, 0.0, 0.0], [3, 0.8, 0.0], [3, 0.9, 0.0]])
    release = Release("fedpft", features, torch.zeros(3, dtype=torch.long), set_level=True, epsilon=math.inf)
    result = evaluate_release(release, StubReconstructor(targets), targets, lpips=lpips_metric,
                              samples_per_feature=2, top_fractions=(0.25,))
    rows = {(r.selection, r.top): r for r in result.rows}
    assert rows[("oracle", "25%")].ssim == pytest.approx(1.0) and rows[("oracle", "25%")].set_size == 3
    assert torch.equal(result.matched[1], targets[1])
    assert rows[("all", "all")].n == 4 and rows[("all", "all")].ssim < 0.9
    baseline, matched = nearest_image_baseline(targets[:2], targets, lpips=lpips_metric, top_fractions=(0.5,))
    assert [r.selection for r in baseline] == ["all", "oracle"] and baseline[0].ssim == pytest.approx(1.0)
    assert isinstance(baseline[0], AttackRow) and torch.equal(matched, targets[:2])


# -- schemes --------------------------------------------------------------------------------------------------------

def test_releases():
    g = torch.Generator().manual_seed(0)
    features = torch.randn(60, 6, generator=g)
    features = features / features.norm(dim=1, keepdim=True)
    labels = torch.arange(60) % 3
    raw = make_release("raw", features, labels, num_classes=3)
    assert not raw.set_level and torch.equal(raw.features, features) and raw.epsilon == math.inf
    fedpft = make_release("fedpft", features, labels, num_classes=3, components=2)
    assert fedpft.set_level and fedpft.features.shape == (60, 6) and fedpft.details["set_size"] == 60
    assert torch.allclose(fedpft.features.norm(dim=1), torch.ones(60), atol=1e-5)
    assert sorted(torch.bincount(fedpft.labels).tolist()) == [20, 20, 20]
    dp1 = make_release("dp-fedpft", features, labels, num_classes=3, epsilon=1.0)
    dp8 = make_release("dp-fedpft", features, labels, num_classes=3, epsilon=8.0)
    assert dp1.epsilon == 1.0 and dp1.label == "dp-fedpft (eps=1)"
    assert dp1.details["sigmas"]["sum"] > 4 * dp8.details["sigmas"]["sum"]
    with pytest.raises(ConfigError, match="valid schemes: raw, fedpft, dp-fedpft"):
        make_release("gan", features, labels, num_classes=3)
    with pytest.raises(ConfigError, match="epsilon is required"):
        make_release("dp-fedpft", features, labels, num_classes=3)


def test_cli_rejects_bad_values_before_any_work(tmp_path, capsys):
    assert reconstruct_main(["--out", str(tmp_path), "--schemes", "raw,gan"]) == 2
    assert "valid: raw, fedpft, dp-fedpft" in capsys.readouterr().err
    assert reconstruct_main(["--out", str(tmp_path), "--schemes", "dp-fedpft", "--eps", "0"]) == 2
    assert "--eps" in capsys.readouterr().err
    assert reconstruct_main(["--out", str(tmp_path), "--image-size", "8"]) == 2
    assert "--image-size" in capsys.readouterr().err
    assert reconstruct_main(["--out", str(tmp_path), "--covariance", "banana"]) == 2
    assert "full, diag or spherical" in capsys.readouterr().err

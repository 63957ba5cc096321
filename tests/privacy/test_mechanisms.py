"""GaussianMechanism: analytic calibration, empirical noise scale, seeded, secure and hardened noise, validation."""

from __future__ import annotations

import math

import pytest
import torch

from accounting import GaussianEvent, NeighboringRelation
from privfl.errors import ConfigError
from privfl.privacy import GaussianMechanism
from privfl.privacy.mechanisms import standard_normal


def test_known_sigma_and_linear_scaling_in_sensitivity():
    m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    assert m.sigma == pytest.approx(3.7306, abs=1e-3)
    # the noise for a mean of 100 samples clipped to radius 1 (sensitivity 2/100) is 0.02 times that
    small = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=2 * 1.0 / 100)
    assert small.sigma == pytest.approx(0.02 * m.sigma, rel=1e-6)
    # the classic formula would give 4.845 here: the analytic calibration is well below it
    assert m.sigma < Classic.sigma(1.0, 1e-5) - 1.0


class Classic:
    """The textbook calibration, only to show that the tests can tell it apart (never used by privfl)."""

    @staticmethod
    def sigma(epsilon: float, delta: float) -> float:
        return math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def test_event_describes_the_mechanism():
    m = GaussianMechanism(epsilon=2.0, delta=1e-6, sensitivity=0.5, relation="add_or_remove_one")
    assert m.event == GaussianEvent(sigma=m.sigma, sensitivity=0.5, relation=NeighboringRelation.ADD_OR_REMOVE_ONE)


@pytest.mark.parametrize("noise", ["seeded", "secure"])
def test_empirical_std_matches_sigma(noise):
    generator = torch.Generator().manual_seed(0) if noise == "seeded" else None
    m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise=noise, generator=generator)
    draws = m.add_noise(torch.zeros(200_000, dtype=torch.float64))
    # standard error of the std is sigma / sqrt(2 N) ~ 0.006; 2% (~12 SE) cannot be met by the classic 4.845
    assert draws.std().item() == pytest.approx(m.sigma, rel=0.02)
    assert abs(draws.std().item() - Classic.sigma(1.0, 1e-5)) > 0.5
    assert abs(draws.mean().item()) < 0.05


def test_seeded_noise_repeats_and_secure_noise_does_not():
    def run(noise):
        torch.manual_seed(123)  # the experiment seed
        generator = torch.Generator().manual_seed(7) if noise == "seeded" else None
        m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise=noise, generator=generator)
        return m.add_noise(torch.zeros(16))

    assert torch.equal(run("seeded"), run("seeded"))
    assert not torch.equal(run("secure"), run("secure"))


def test_add_noise_keeps_shape_and_dtype():
    m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, generator=torch.Generator().manual_seed(0))
    out = m.add_noise(torch.ones(3, 4, dtype=torch.float64))
    assert out.shape == (3, 4) and out.dtype == torch.float64


@pytest.mark.parametrize("kwargs,named", [
    (dict(epsilon=0.0), "0.0"), (dict(epsilon=-1.0), "-1.0"), (dict(epsilon=math.inf), "inf"),
    (dict(epsilon=math.nan), "nan"), (dict(delta=0.0), "0.0"), (dict(delta=1.0), "1.0"), (dict(delta=2.0), "2.0"),
    (dict(sensitivity=0.0), "0.0"), (dict(sensitivity=-3.0), "-3.0"), (dict(relation="replace_all"), "replace_all"),
    (dict(noise="urandom"), "urandom"),
])
def test_bad_values_raise_config_error_naming_them(kwargs, named):
    values = dict(epsilon=1.0, delta=1e-5, sensitivity=1.0) | kwargs
    with pytest.raises(ConfigError, match=named):
        GaussianMechanism(**values)


def test_secure_noise_refuses_a_generator():
    with pytest.raises(ConfigError, match="generator"):
        GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise="secure", generator=torch.Generator())


def test_seeded_noise_without_its_own_generator_is_refused():
    # torch's global generator is keyed from the run seed in every runtime, so the server could replay it.
    with pytest.raises(ConfigError, match="seeded.*explicit torch.Generator"):
        GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise="seeded")


def test_default_noise_is_secure_unless_a_generator_is_given():
    assert GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0).noise == "secure"
    seeded = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, generator=torch.Generator().manual_seed(1))
    assert seeded.noise == "seeded"
    torch.manual_seed(0)
    first = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0).add_noise(torch.zeros(8))
    torch.manual_seed(0)
    second = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0).add_noise(torch.zeros(8))
    assert not torch.equal(first, second)


def test_non_finite_value_is_refused():
    m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    with pytest.raises(ConfigError, match="NaN or inf"):
        m.add_noise(torch.tensor([0.0, math.nan]))


# -- hardened noise (Opacus' secure_mode sampler) ---------------------------------------------------------------------


def test_hardened_noise_has_the_calibrated_std():
    m = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise="hardened")
    draws = m.add_noise(torch.zeros(1_000_000, dtype=torch.float64))
    # standard error of the std is sigma / sqrt(2 N) ~ 0.0026 (0.07%); 2% catches a sum of four draws divided by 4
    # (std sigma/2) or left undivided (2 sigma), and the classic sigma 4.845
    assert draws.std().item() == pytest.approx(m.sigma, rel=0.02)
    assert abs(draws.mean().item()) < 0.02
    # a Gaussian's fourth moment is 3 sigma^4 (kurtosis 3); SE of the sample kurtosis ~ sqrt(24 / N) ~ 0.005
    z = draws / draws.std()
    assert (z ** 4).mean().item() == pytest.approx(3.0, abs=0.05)


def test_hardened_noise_changes_neither_sigma_nor_the_event():
    kwargs = dict(epsilon=0.5, delta=1e-6, sensitivity=0.02, relation="add_or_remove_one")
    secure, hardened = GaussianMechanism(**kwargs), GaussianMechanism(**kwargs, noise="hardened")
    assert hardened.noise == "hardened"
    assert hardened.sigma == secure.sigma and hardened.event == secure.event


def test_hardened_sampler_throws_one_draw_away_and_halves_the_sum_of_four():
    hardened = standard_normal((5, 3), generator=torch.Generator().manual_seed(11), hardened=True,
                               dtype=torch.float64)
    g = torch.Generator().manual_seed(11)
    torch.randn((1, 1), generator=g, dtype=torch.float64)
    expected = sum(torch.randn((5, 3), generator=g, dtype=torch.float64) for _ in range(4)) / 2
    assert torch.allclose(hardened, expected, rtol=0, atol=1e-15)
    plain = standard_normal((5, 3), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    assert torch.equal(plain, torch.randn((5, 3), generator=torch.Generator().manual_seed(11), dtype=torch.float64))


def test_hardened_noise_is_os_seeded_and_refuses_a_generator():
    torch.manual_seed(0)
    first = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise="hardened").add_noise(torch.zeros(8))
    torch.manual_seed(0)
    second = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise="hardened").add_noise(torch.zeros(8))
    assert not torch.equal(first, second)
    with pytest.raises(ConfigError, match="noise='hardened' draws from an OS-seeded generator"):
        GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise="hardened", generator=torch.Generator())

"""label_shift_kl against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from privfl.data import label_shift_kl
from privfl.errors import ConfigError


def test_known_value_with_smoothing() -> None:
    # smoothing 1: P_novel = (3/4, 1/4); training (1, 1) -> Q = (1/2, 1/2), training (0, 2) -> Q = (1/4, 3/4).
    # KL to the first  = 3/4 ln(3/2) + 1/4 ln(1/2) = 0.130812...; to the second = 1/2 ln 3 = 0.549306...
    first = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert first == pytest.approx(0.1308120, abs=1e-6)
    assert label_shift_kl([2, 0], [[1, 1], [0, 2]], smoothing=1.0) == pytest.approx(first, rel=1e-12)
    assert label_shift_kl([2, 0], [[0, 2]], smoothing=1.0) == pytest.approx(0.5 * math.log(3), rel=1e-12)


def test_default_smoothing_keeps_a_missing_class_finite() -> None:
    # P = (1001/2002, 1001/2002) over Q = (1000.001/1000.002, 0.001/1000.002): about 0.5 ln(0.5 / 1e-6).
    value = label_shift_kl(torch.tensor([1000, 1000]), torch.tensor([[1000, 0]]))
    expected = 0.5 * math.log(0.5 / (1000.001 / 1000.002)) + 0.5 * math.log(0.5 / (0.001 / 1000.002))
    assert value == pytest.approx(expected, rel=1e-9)


def test_identical_mix_is_zero_and_the_minimum_is_taken() -> None:
    assert label_shift_kl([5, 5, 0], [[9, 0, 1], [5, 5, 0]]) == pytest.approx(0.0, abs=1e-12)


def test_bad_inputs_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="3 classes but training_histograms have 2"):
        label_shift_kl([1, 2, 3], [[1, 2]])
    with pytest.raises(ConfigError, match="non-negative"):
        label_shift_kl([1, -2], [[1, 2]])
    with pytest.raises(ConfigError, match="smoothing=-1"):
        label_shift_kl([1, 2], [[1, 2]], smoothing=-1)

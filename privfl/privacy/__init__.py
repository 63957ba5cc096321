"""The privacy layer: the only place where noise is added to anything that leaves a client.

- :mod:`privfl.privacy.mechanisms`: :class:`GaussianMechanism` (analytic Gaussian calibration, seeded or secure noise).
- :mod:`privfl.privacy.sensitivity`: :class:`SensitivityCertificate`, sensitivities derived from structure, with proofs.
- :mod:`privfl.privacy.privatize`: :func:`privatize` turns a mean-pooled DeepSet into a DP descriptor release.
- :mod:`privfl.privacy.labelled`: :func:`release_labelled_mean`, the same release for embeddings of labelled records
  (PeFLL's descriptor).
- :mod:`privfl.privacy.gradient_mean`: :func:`release_gradient_mean`, the gradient of a mean over a client's records
  (per-record gradients clipped, averaged, noised; PeFLL's embedding gradient, IT-PFL-HN's encoder step).
- :mod:`privfl.privacy.dp_gmm`: the DP-GMM release of DP-FedPFT; :mod:`privfl.privacy.dp_sgd`: DP-SGD through Opacus;
  :mod:`privfl.privacy.client_dp`: the joint clip of a client's whole release (client-level DP, whose modes are
  :mod:`privfl.privacy.training`'s).
"""

from privfl.privacy.mechanisms import GaussianMechanism
from privfl.privacy.privatize import PrivateEncoder, privatize
from privfl.privacy.sensitivity import SensitivityCertificate, certify_mean_of_batch_means, certify_mean_of_clipped

__all__ = ["GaussianMechanism", "PrivateEncoder", "SensitivityCertificate", "certify_mean_of_batch_means",
           "certify_mean_of_clipped", "privatize"]

from privfl.privacy.dp_gmm import DPGaussianRelease, release_class_gaussians, sample_features  # noqa: E402

__all__ += ["DPGaussianRelease", "release_class_gaussians", "sample_features"]

from privfl.privacy.labelled import certify_labelled_mean, release_labelled_mean  # noqa: E402

__all__ += ["certify_labelled_mean", "release_labelled_mean"]

from privfl.privacy.gradient_mean import certify_gradient_mean, release_gradient_mean  # noqa: E402

__all__ += ["certify_gradient_mean", "release_gradient_mean"]

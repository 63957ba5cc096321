"""ODPFL-HN's settings (:class:`ODPFLHNConfig`): local training, the server's optimisers, the encoder and
hypernetwork architecture, descriptors and the generated part, each checked on construction, and the refusals of the
privacy modes under which a setting cannot hold. The method itself: :mod:`privfl.methods.odpflhn`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accounting.validation import is_finite
from privfl.errors import ConfigError, check
from privfl.methods.base import MethodConfig
from privfl.methods.shared_part import check_shared_settings
from privfl.models.encoders import ENCODERS, PRIVATIZABLE
from privfl.models.set_encoders import PHI_HEADS, PSI_KINDS
from privfl.privacy.training import CENTRAL, RECORD, NovelPrivacy, TrainingPrivacy

#: How a client's descriptor is computed: from its whole training split, or as the mean over random batches.
DESCRIPTOR_MODES = ("full", "batch_mean")


@dataclass(frozen=True)
class ODPFLHNConfig(MethodConfig):
    """ODPFL-HN's settings (the paper's App. C; defaults from pFedHN's code where the paper gives a grid;
    docs/papers.md, ODPFL-HN, "Settings").

    Local training: ``lr`` (client), ``local_steps`` minibatch steps, or ``local_epochs`` epochs over the training
    split when given (then ``local_steps`` is ignored), ``batch_size``, ``local_momentum`` (0.9 in the paper),
    ``local_weight_decay``.
    Server: ``hn_lr``, ``hn_weight_decay``, ``encoder_lr`` (0: the encoder stays at its initialisation, and a round
    has two stages: no client computes or releases an encoder gradient), ``encoder_weight_decay`` (``None``: the
    hypernetwork's; the paper gives no encoder optimiser), ``server_momentum`` (SGD momentum of both), ``grad_clip``
    (L2 clip of each
    averaged gradient, ``None`` for none).
    Architecture: ``encoder`` (a name of :data:`privfl.models.encoders.ENCODERS`), ``encoder_hidden``,
    ``encoder_clip`` (``dp_deepset``, ignored by the others: phi's outputs are projected onto the L2 ball of this
    radius in training, as privatize does on release; ``None`` for none), ``encoder_sphere`` (with a clip: scale phi's
    outputs onto the sphere of that radius, the paper's normalisation of phi onto the unit sphere in its DP
    experiment, section 7; it keeps the encoder from
    shrinking phi towards 0, which the ball allows), ``encoder_phi_hidden`` (``dp_deepset`` only: a deeper phi),
    ``encoder_phi_head`` (``dp_deepset`` only: ``"relu"``, or ``"softmax"``: phi softly assigns each sample to
    ``encoder_hidden`` learned prototypes, so the pooled mean is a histogram; set ``encoder_sphere=False`` with it),
    ``encoder_temperature`` (that softmax's temperature), ``encoder_psi`` (``dp_deepset`` only: ``"mlp"``,
    ``"linear"`` or ``"identity"``, the descriptor then being the pooled mean itself, of ``encoder_hidden``
    coordinates), ``embed_dim`` (``None``: ``floor(N_train / 4)``, at least 2; the paper's d_e = N/4, App. C;
    ignored with an identity
    psi), ``hn_hidden``, ``hn_layers``, ``standardize_descriptors`` (a
    :class:`~privfl.models.hypernetwork.DescriptorStandardizer` in front of the hypernetwork, refitted every round to
    the training clients' latest descriptors; "Making the descriptor matter" in docs/methods/hypernetworks.md,
    "ODPFL-HN").
    Descriptors: ``descriptor`` ``"full"`` (the whole training split as one set, the default) or ``"batch_mean"``
    (mean of the descriptors of random batches of ``descriptor_batch_size``); ``train_mean_noise`` (``dp_deepset``
    only): std of Gaussian noise added to the pooled mean during training (noise-aware training, not in the paper;
    docs/papers.md, ODPFL-HN, U12).
    Generated part: ``generated``, ``shared_lr`` and ``shared_momentum`` as in
    :class:`~privfl.methods.pfedhn.PFedHNConfig`. Under record-level DP the shared part's noise is averaged over the
    round's clients, and the hypernetwork reads only the few generated coordinates of each noised change.
    Privacy is the run's (``RunConfig.privacy`` for training clients, ``RunConfig.novel_privacy`` for the novel
    client's descriptor); the modes each setting allows: docs/methods/hypernetworks.md, "ODPFL-HN".
    """

    lr: float = 0.05
    local_steps: int = 20
    local_epochs: int | None = None
    batch_size: int = 64
    local_momentum: float = 0.9
    local_weight_decay: float = 5e-5
    hn_lr: float = 0.01
    hn_weight_decay: float = 1e-3
    encoder_lr: float = 0.01
    encoder_weight_decay: float | None = None
    server_momentum: float = 0.9
    grad_clip: float | None = 50.0
    encoder: str = "dp_deepset"
    encoder_hidden: int = 100
    encoder_clip: float | None = 1.0
    encoder_sphere: bool = True
    encoder_phi_hidden: int | None = None
    encoder_phi_head: str = "relu"
    encoder_temperature: float = 1.0
    encoder_psi: str = "mlp"
    standardize_descriptors: bool = False
    embed_dim: int | None = None
    hn_hidden: int = 100
    hn_layers: int = 3
    descriptor: str = "full"
    descriptor_batch_size: int = 128
    train_mean_noise: float = 0.0
    generated: str = "all"
    shared_lr: float = 1.0
    shared_momentum: float = 0.0

    def __post_init__(self) -> None:
        check_shared_settings(self.generated, self.shared_lr, self.shared_momentum)
        for name in ("lr", "hn_lr", "encoder_temperature"):
            check.require(is_finite(getattr(self, name)) and getattr(self, name) > 0, name, getattr(self, name),
                          "a finite number > 0")
        check.require(is_finite(self.encoder_lr) and self.encoder_lr >= 0, "encoder_lr", self.encoder_lr,
                      "a finite number >= 0 (0: the encoder stays at its initialisation)")
        for name in ("local_weight_decay", "hn_weight_decay", "train_mean_noise"):
            check.require(is_finite(getattr(self, name)) and getattr(self, name) >= 0, name, getattr(self, name),
                          "a finite number >= 0")
        check.require(self.encoder_weight_decay is None or (is_finite(self.encoder_weight_decay)
                                                       and self.encoder_weight_decay >= 0),
                      "encoder_weight_decay", self.encoder_weight_decay, "None or a finite number >= 0")
        for name in ("local_momentum", "server_momentum"):
            check.require(is_finite(getattr(self, name)) and 0 <= getattr(self, name) < 1, name, getattr(self, name),
                          "in [0, 1)")
        for name in ("local_steps", "batch_size", "encoder_hidden", "hn_hidden", "descriptor_batch_size"):
            value = getattr(self, name)
            check.require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name, value,
                          "an integer >= 1")
        for name in ("local_epochs", "embed_dim", "encoder_phi_hidden"):
            value = getattr(self, name)
            check.require(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1),
                          name, value, "None or an integer >= 1")
        check.require(isinstance(self.hn_layers, int) and self.hn_layers >= 0, "hn_layers", self.hn_layers,
                      "an integer >= 0")
        check.require(self.grad_clip is None or (is_finite(self.grad_clip) and self.grad_clip > 0), "grad_clip",
                      self.grad_clip, "None or a finite number > 0")
        check.require(self.encoder in ENCODERS, "encoder", self.encoder, f"one of {', '.join(sorted(ENCODERS))}")
        check.require(self.descriptor in DESCRIPTOR_MODES, "descriptor", self.descriptor,
                      f"one of {', '.join(DESCRIPTOR_MODES)}")
        check.require(self.encoder_clip is None or (is_finite(self.encoder_clip) and self.encoder_clip > 0),
                      "encoder_clip", self.encoder_clip, "None or a finite L2 radius > 0")
        check.require(self.encoder_phi_head in PHI_HEADS, "encoder_phi_head", self.encoder_phi_head,
                      f"one of {', '.join(PHI_HEADS)}")
        check.require(self.encoder_psi in PSI_KINDS, "encoder_psi", self.encoder_psi, f"one of {', '.join(PSI_KINDS)}")
        check.require(isinstance(self.standardize_descriptors, bool), "standardize_descriptors",
                      self.standardize_descriptors, "True or False")
        if self.encoder_psi == "identity" and self.embed_dim is not None and self.embed_dim != self.encoder_hidden:
            raise ConfigError(f"encoder_psi='identity' releases phi's pooled mean, so the descriptor has "
                              f"encoder_hidden={self.encoder_hidden} coordinates; embed_dim={self.embed_dim} differs "
                              "(leave embed_dim unset)")
        if self.encoder_phi_head == "softmax" and self.encoder_sphere:
            raise ConfigError("encoder_phi_head='softmax' puts phi's outputs on the probability simplex; "
                              "encoder_sphere=True would rescale them off it (set encoder_sphere=False)")
        dp_only = {"encoder_phi_hidden": self.encoder_phi_hidden, "train_mean_noise": self.train_mean_noise or None,
                   "encoder_phi_head": None if self.encoder_phi_head == "relu" else self.encoder_phi_head,
                   "encoder_psi": None if self.encoder_psi == "mlp" else self.encoder_psi,
                   "encoder_temperature": None if self.encoder_temperature == 1.0 else self.encoder_temperature}
        for name, value in dp_only.items():
            if value is not None and self.encoder != "dp_deepset":
                raise ConfigError(f"{name}={value!r} applies only to encoder='dp_deepset', got "
                                  f"encoder={self.encoder!r} (set {name} to None / 0)")

    def check_privacy(self, privacy: TrainingPrivacy, novel_privacy: NovelPrivacy) -> None:
        """Refuse, before the run, the settings under which a privacy mode cannot hold (docs/methods/hypernetworks.md,
        "ODPFL-HN")."""
        if novel_privacy.private and self.encoder not in PRIVATIZABLE:
            raise ConfigError(f"novel_privacy epsilon={novel_privacy.epsilon!r} needs a privatizable encoder "
                              f"({', '.join(PRIVATIZABLE)}), got encoder={self.encoder!r}: its sensitivity does not "
                              "shrink with n (docs/papers.md, ODPFL-HN, E2)")
        if privacy.mode == RECORD:
            if self.encoder not in PRIVATIZABLE:
                raise ConfigError(f"record-level DP releases each training client's descriptor through privatize, "
                                  f"which needs encoder in {', '.join(PRIVATIZABLE)}, got encoder={self.encoder!r}")
            if self.descriptor != "full":
                raise ConfigError(f"record-level DP (add or remove one record) needs descriptor='full': with "
                                  f"descriptor={self.descriptor!r} adding a record changes the random batches")
        if privacy.mode == CENTRAL and self.standardize_descriptors:
            raise ConfigError("central DP protects what leaves the aggregator, and standardize_descriptors=True "
                              "fits the hypernetwork's input statistics to the clients' descriptors in the clear: "
                              "the shared model would carry them; use standardize_descriptors=False, or record-level "
                              "or local DP (there the descriptors are private releases)")

    @property
    def frozen_encoder(self) -> bool:
        """Whether the encoder stays at its initialisation (``encoder_lr=0``): no stage 2, no encoder gradient."""
        return self.encoder_lr == 0

    def encoder_options(self) -> dict[str, Any]:
        """Keyword options of :func:`~privfl.models.encoders.build_encoder` for this config."""
        if self.encoder == "dp_deepset":
            return {"hidden": self.encoder_hidden, "clip": self.encoder_clip, "phi_hidden": self.encoder_phi_hidden,
                    "sphere": self.encoder_sphere, "phi_head": self.encoder_phi_head, "psi": self.encoder_psi,
                    "temperature": self.encoder_temperature}
        if self.encoder == "set_transformer":
            return {"dim": self.encoder_hidden}
        if self.encoder in ("deepset", "dss"):
            return {"hidden": self.encoder_hidden + self.encoder_hidden % 2}   # even: half mean, half max
        return {}

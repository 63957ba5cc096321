"""The network of the reconstructor: :class:`FeatureConditionedUNet`, a diffusers ``UNet2DModel`` whose timestep
embedding gets an MLP of the whitened feature added, optionally reading a decoder's estimate of the image beside x_t.

:class:`~attacks.reconstructor.Reconstructor` builds it, trains it and samples from it; the architecture and its
choices: docs/attacks.md, "The diffusion reconstructor".
"""

from __future__ import annotations

import torch
from torch import nn

from attacks.reconstructor_config import ReconstructorConfig
from privfl.errors import ConfigError

__all__ = ["FeatureConditionedUNet"]


class FeatureConditionedUNet(nn.Module):
    """``UNet2DModel`` whose timestep embedding gets ``MLP(whitened feature)`` added (the condition).

    The whitening is ``(f - feature_mean) @ feature_projection`` (buffers, saved with the weights; set by
    :meth:`~attacks.reconstructor.Reconstructor.set_feature_statistics`).

    ``forward(x_t, t, features, keep, guide)``: ``keep`` is a boolean ``[B]`` mask; where it is False the condition
    embedding is the null embedding (zero), i.e. the unconditional model; ``guide`` the decoder's estimates on [0, 1]
    (``guide_image`` only), zeroed with the condition.
    """

    feature_mean: torch.Tensor   # buffers (register_buffer)
    feature_projection: torch.Tensor

    def __init__(self, config: ReconstructorConfig) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        levels = len(config.block_channels)
        down = ["DownBlock2D"] * levels
        up = ["UpBlock2D"] * levels
        if config.attention:
            down[-1], up[0] = "AttnDownBlock2D", "AttnUpBlock2D"
        self.guide_image = config.guide_image
        self.unet = UNet2DModel(
            sample_size=config.image_size, in_channels=config.channels * (2 if config.guide_image else 1),
            out_channels=config.channels,
            block_out_channels=config.block_channels, layers_per_block=config.layers_per_block,
            down_block_types=tuple(down), up_block_types=tuple(up), norm_num_groups=config.norm_groups,
            resnet_time_scale_shift="scale_shift", class_embed_type="identity", add_attention=config.mid_attention)
        width = 4 * config.block_channels[0]  # UNet2DModel's time-embedding width
        r = config.condition_width
        first, last = nn.Linear(r, width), nn.Linear(width, width)
        self.condition = nn.Sequential(first, nn.SiLU(), last)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.register_buffer("feature_mean", torch.zeros(config.feature_dim))
        self.register_buffer("feature_projection", torch.eye(config.feature_dim, r))

    def whiten(self, features: torch.Tensor) -> torch.Tensor:
        """``[n, d]`` features -> ``[n, condition_width]`` whitened (or standardised) coordinates."""
        return (features - self.feature_mean) @ self.feature_projection

    def condition_embedding(self, features: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        embedding = self.condition(self.whiten(features))
        if keep is not None:
            embedding = embedding * keep.to(embedding.dtype)[:, None]
        return embedding

    def forward(self, x: torch.Tensor, t: torch.Tensor, features: torch.Tensor,
                keep: torch.Tensor | None = None, guide: torch.Tensor | None = None) -> torch.Tensor:
        if self.guide_image:
            if guide is None:
                raise ConfigError("this reconstructor reads a decoder's estimate beside x_t (guide_image=True); "
                                  "pass the guide images")
            g = guide * 2.0 - 1.0   # on x_0's scale; the null input (condition dropped) is zero
            if keep is not None:
                g = g * keep.to(g.dtype)[:, None, None, None]
            x = torch.cat([x, g.to(x.dtype)], dim=1)
        return self.unet(x, t, class_labels=self.condition_embedding(features, keep)).sample

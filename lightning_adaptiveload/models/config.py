"""The configuration of :class:`~lightning_adaptiveload.models.video_dit.VideoDiT` and its analytic FLOP count.

:class:`VideoDiTConfig` (a dataclass, the presets ``tiny``, ``wan-1.3b`` and ``wan-14b``) and
:func:`forward_flops`, the one formula of the model's FLOPs that the monitor, the module and the planner
share. Both are re-exported by :mod:`~lightning_adaptiveload.models.video_dit`. Plain Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["VideoDiTConfig", "forward_flops", "padded_text_len"]


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------

_PRESETS: dict[str, dict[str, Any]] = {
    # Trains on 2 CPU cores on the "tiny" mix (16-channel latents, 24-225 tokens per sample).
    "tiny": dict(dim=64, num_layers=2, num_heads=4, ffn_dim=192, text_dim=32, freq_dim=64),
    # Wan 2.1 T2V-1.3B and T2V-14B.
    # text_len 512: Wan's own text length (umT5 pads every prompt to 512 tokens).
    "wan-1.3b": dict(dim=1536, num_layers=30, num_heads=12, ffn_dim=8960, text_len=512),
    "wan-14b": dict(dim=5120, num_layers=40, num_heads=40, ffn_dim=13824, text_len=512),
}


@dataclass
class VideoDiTConfig:
    """Hyper-parameters of :class:`VideoDiT`; defaults are Wan 2.1 T2V-1.3B.

    Attributes:
        dim: model width D.
        num_layers: number of transformer blocks.
        num_heads: attention heads; ``dim / num_heads`` must be even (RoPE rotates channel pairs).
        ffn_dim: hidden width of the GELU(tanh) FFN.
        in_channels: latent channels C (16 for the Wan 2.1 VAE).
        out_channels: predicted channels (the velocity has the latent's channels).
        patch_size: (pt, ph, pw) of the 3D patch embedding.
        text_dim: width of the text encoder's states (4096 for umT5-XXL).
        freq_dim: width of the sinusoidal timestep features.
        eps: epsilon of every LayerNorm and RMSNorm.
        qk_norm: RMSNorm on queries and keys (over the full width, as Wan).
        cross_attn_norm: affine LayerNorm before cross-attention (Wan's ``norm3``).
        rope_theta: RoPE base.
        text_len: pad the text states with masked-out rows to this many tokens (the presets ``wan-1.3b``
            and ``wan-14b``: 512, Wan's own), so that every batch's cross-attention has one key length.
            The result is the same (the rows are masked); what changes is speed: cuDNN attention builds
            an execution graph, 70-85 ms on an H200, for every new shape, and with the text padded only
            to a multiple of 8 each new prompt length cost one such build in the forward and one in the
            backward, at random steps on each rank (``docs/lab_notebook.md``). Longer text is padded to a
            multiple of 8 instead, never cut. ``None``: a multiple of 8 only (the ``tiny`` preset).
    """

    dim: int = 1536
    num_layers: int = 30
    num_heads: int = 12
    ffn_dim: int = 8960
    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = field(default=(1, 2, 2))
    text_dim: int = 4096
    freq_dim: int = 256
    eps: float = 1e-6
    qk_norm: bool = True
    cross_attn_norm: bool = True
    rope_theta: float = 10000.0
    text_len: int | None = None

    def __post_init__(self) -> None:
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(
                f"VideoDiTConfig.patch_size must be 3 positive ints (pt, ph, pw), got {self.patch_size}"
            )
        for key in ("dim", "num_layers", "num_heads", "ffn_dim", "in_channels", "out_channels", "text_dim"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"VideoDiTConfig.{key} must be a positive int, got {value!r}")
        if self.dim % self.num_heads:
            raise ValueError(
                f"VideoDiTConfig.dim={self.dim} is not divisible by num_heads={self.num_heads}; "
                "choose a width that is a multiple of the head count"
            )
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(
                f"VideoDiTConfig: head dim dim/num_heads = {self.head_dim} must be even and >= 6 "
                "(3D RoPE rotates channel pairs on three axes)"
            )
        if self.text_len is not None and (
            isinstance(self.text_len, bool) or not isinstance(self.text_len, int) or self.text_len < 1
        ):
            raise ValueError(f"VideoDiTConfig.text_len must be a positive int or None, got {self.text_len!r}")
        if self.freq_dim % 2:
            raise ValueError(f"VideoDiTConfig.freq_dim must be even, got {self.freq_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def patch_volume(self) -> int:
        return self.patch_size[0] * self.patch_size[1] * self.patch_size[2]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> VideoDiTConfig:
        """A named configuration, optionally with some fields replaced.

        Args:
            name: ``"tiny"``, ``"wan-1.3b"`` or ``"wan-14b"``.
            **overrides: fields of :class:`VideoDiTConfig` to replace, e.g. ``num_layers=2``.

        Raises:
            ValueError: unknown preset name or unknown field.
        """
        if name not in _PRESETS:
            raise ValueError(f"unknown VideoDiT preset {name!r}; choose one of {sorted(_PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown VideoDiTConfig field(s) {unknown} in overrides for preset {name!r}; "
                f"valid fields are {sorted(known)}"
            )
        return cls(**{**_PRESETS[name], **overrides})

    @staticmethod
    def presets() -> list[str]:
        return sorted(_PRESETS)


#: ``VideoDiT`` pads the text states with masked-out rows to ``config.text_len`` or else a multiple of this
#: many (one compiled graph for every text length, aligned rows for the attention kernels); its FLOPs count
#: the padded rows (:func:`padded_text_len`).
TEXT_ALIGN = 8


def padded_text_len(config: VideoDiTConfig, text_len: int) -> int:
    """The text length ``VideoDiT`` runs for ``text_len`` tokens: ``config.text_len`` where the text fits
    it, else the next multiple of :data:`TEXT_ALIGN`; 0 without text."""
    text_len = int(text_len)
    if text_len <= 0:
        return 0
    if config.text_len is not None and text_len <= config.text_len:
        return -(-int(config.text_len) // TEXT_ALIGN) * TEXT_ALIGN
    return -(-text_len // TEXT_ALIGN) * TEXT_ALIGN


def forward_flops(config: VideoDiTConfig, seq_len: int, text_len: int = 0, text_align: int = 1) -> int:
    """Forward FLOPs of one sample: matmuls and convolutions only, 2 FLOPs per multiply-add.

    With S video tokens, L text tokens (the padded length the batch carries, rounded up to a multiple of
    ``text_align`` where the model pads it further; 0 = no text), width D,
    FFN width F, N blocks, patch volume P, channels C_in / C_out, text width D_t, freq width D_f::

        patch embed     2 S (C_in P) D
        time embed      2 (D_f D + D D) + 2 D (6 D)
        text embed      2 L (D_t D + D D)                                               (if L > 0)
        per block       self-attn projections 8 S D^2 + scores and values 4 S^2 D
                        cross-attn q/o 4 S D^2 + k/v 4 L D^2 + scores and values 4 S L D   (if L > 0)
                        FFN 4 S D F
        head            2 S D (C_out P)

    Normalisations, RoPE, activations and softmax are not counted (a few percent at Wan's widths). A
    training step (forward + backward) costs 3x this, plus one more forward of the blocks with activation
    checkpointing; report MFU with 3x, the usual convention.

    Args:
        config: the model configuration.
        seq_len: video tokens per sample, T/pt * H/ph * W/pw.
        text_len: text tokens per sample (padded length), 0 when the model runs without text.
        text_align: the model pads the text to a multiple of this (``VideoDiT``: :data:`TEXT_ALIGN`; 1: not).
    """
    cfg = config
    s, d, f, n, p = int(seq_len), cfg.dim, cfg.ffn_dim, cfg.num_layers, cfg.patch_volume
    lt = -(-int(text_len) // int(text_align)) * int(text_align)
    total = 2 * s * cfg.in_channels * p * d
    total += 2 * (cfg.freq_dim * d + d * d) + 2 * d * 6 * d
    block = 8 * s * d * d + 4 * s * s * d + 4 * s * d * f
    if lt > 0:
        total += 2 * lt * (cfg.text_dim * d + d * d)
        block += 4 * s * d * d + 4 * lt * d * d + 4 * s * lt * d
    total += n * block
    total += 2 * s * d * cfg.out_channels * p
    return total

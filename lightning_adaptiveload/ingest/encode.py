"""Pixels and captions to Wan latents and text states (ingest's encoding step, without Lightning).

:func:`encode_video` normalises the VAE posterior's mode with the config's ``latents_mean`` /
``latents_std``; :func:`encode_text` keeps the umT5 states of the caption's real tokens.
"""

from __future__ import annotations

import torch

from lightning_adaptiveload.ingest.media import TEXT_MAX_LENGTH

__all__ = ["encode_text", "encode_video", "latent_stats"]


def latent_stats(vae) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std), each (1, C, 1, 1, 1) float32, from the VAE config's ``latents_mean``/``latents_std``.

    Raises:
        ValueError: the config lacks them (not a Wan VAE).
    """
    mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
    if mean is None or std is None:
        raise ValueError(
            "the VAE config has no latents_mean / latents_std; ingest needs Wan's AutoencoderKLWan config"
        )
    return (
        torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1, 1),
        torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1, 1),
    )


@torch.no_grad()
def encode_video(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Wan-normalised latents of a clip: ``(posterior mode - latents_mean) / latents_std``.

    The posterior's mode (not a sample) is what Wan's own ``WanVAE.encode`` returns, and the
    normalisation is the inverse of what diffusers' Wan pipelines apply before decoding.

    Args:
        vae: a diffusers ``AutoencoderKLWan``.
        pixels: (B, 3, T, H, W) in [-1, 1], T = 4k + 1, H and W multiples of 8.

    Returns:
        (B, z_dim, 1 + (T - 1) / 4, H / 8, W / 8) float32.
    """
    param = next(vae.parameters())
    z = vae.encode(pixels.to(device=param.device, dtype=param.dtype)).latent_dist.mode().float()
    mean, std = latent_stats(vae)
    return (z - mean.to(z.device)) / std.to(z.device)


@torch.no_grad()
def encode_text(tokenizer, text_encoder, caption: str, max_length: int = TEXT_MAX_LENGTH) -> torch.Tensor:
    """umT5 states of the caption's real tokens (Wan trims padding): (L, D) float32, L <= ``max_length``."""
    tokens = tokenizer(caption, truncation=True, max_length=max_length, return_tensors="pt")
    device = next(text_encoder.parameters()).device
    out = text_encoder(
        input_ids=tokens["input_ids"].to(device), attention_mask=tokens["attention_mask"].to(device)
    ).last_hidden_state
    return out[0].float()

"""Training FLOPs of a diffusers ``WanTransformer3DModel`` by the formula of :class:`VideoDiT`.

``WanTransformer3DModel`` has the block structure of :class:`~lightning_adaptiveload.models.VideoDiT`
(patch embedding, time and text embeddings, blocks of self-attention, cross-attention and FFN, a linear
head), so its FLOPs are :func:`~lightning_adaptiveload.models.config.forward_flops` of its config: one
formula for both. A LightningModule holding a Wan returns :func:`wan_flops_per_batch` from its
``flops_per_batch``, which :class:`~lightning_adaptiveload.LoadBalanceMonitor` reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch

from lightning_adaptiveload.models.config import forward_flops
from lightning_adaptiveload.stats import TRAINING_FLOPS_PER_FORWARD

__all__ = ["find_wan_config", "wan_flops_per_batch"]


def _wan_as_video_dit(config: Any) -> SimpleNamespace:
    """The fields of :func:`forward_flops` from a diffusers ``WanTransformer3DModel`` config."""
    get = config.get if isinstance(config, Mapping) else lambda k, d=None: getattr(config, k, d)
    patch = tuple(int(p) for p in get("patch_size", (1, 2, 2)))
    in_channels = int(get("in_channels", 16))
    return SimpleNamespace(
        dim=int(get("num_attention_heads")) * int(get("attention_head_dim")),
        ffn_dim=int(get("ffn_dim")),
        num_layers=int(get("num_layers")),
        patch_volume=math.prod(patch),
        patch_size=patch,
        in_channels=in_channels,
        out_channels=int(get("out_channels", None) or in_channels),
        freq_dim=int(get("freq_dim", 256)),
        text_dim=int(get("text_dim", 4096)),
    )


def wan_flops_per_batch(config: Any, batch: Mapping[str, Any]) -> float:
    """Training FLOPs (3x forward) of one batch through a diffusers ``WanTransformer3DModel``.

    Counts the matmuls at 2 FLOPs per multiply-add with the formula of
    :func:`~lightning_adaptiveload.models.config.forward_flops` (self-attention with its ``S^2`` term,
    cross-attention over the batch's padded text length, FFN, embeddings, head); norms, RoPE and
    activations are left out. The image branch of Wan's image-to-video variant is not counted.

    Args:
        config: the model's ``config`` (a diffusers ``FrozenDict`` or any mapping / object with
            ``num_layers``, ``num_attention_heads``, ``attention_head_dim``, ``ffn_dim``, ``patch_size``,
            ``in_channels``, ``out_channels``, ``freq_dim``, ``text_dim``).
        batch: a batch of the data path: ``latents`` (B, C, T, H, W), ``text`` (B, L, D) or None; or a
            pack (``docs/data_path.md``, "Packed batches"): ``latents`` a list of (C, T_i, H_i, W_i), ``text``
            (N, L, D) or None, counted as its samples one by one, each with the pack's padded text length L
            (what a model without varlen attention runs, e.g. ``examples/your_own_model``).

    Returns:
        FLOPs of forward + backward of the batch on this rank.

    Example::

        def flops_per_batch(self, batch):  # on your LightningModule
            return wan_flops_per_batch(self.transformer.config, batch)
    """
    cfg = _wan_as_video_dit(config)
    pt, ph, pw = cfg.patch_size
    text = batch.get("text")
    text_len = 0 if text is None else int(text.shape[1])
    latents = batch["latents"]
    if isinstance(latents, (list, tuple)):  # a pack: samples of different shapes
        grids = [tuple(int(v) for v in x.shape[-3:]) for x in latents]
    else:
        b, _, t, h, w = latents.shape
        grids = [(int(t), int(h), int(w))] * int(b)
    counts: dict[tuple[int, int, int], int] = {}
    for grid in grids:
        counts[grid] = counts.get(grid, 0) + 1
    forward = sum(
        n * forward_flops(cfg, (t // pt) * (h // ph) * (w // pw), text_len)  # type: ignore[arg-type]
        for (t, h, w), n in counts.items()
    )
    return TRAINING_FLOPS_PER_FORWARD * forward


def find_wan_config(module: torch.nn.Module) -> Any:
    """The config of the first diffusers ``WanTransformer3DModel`` inside ``module``, or None.

    Matched by class name (also for subclasses) so that diffusers need not be imported here.
    """
    for sub in module.modules():
        names = {cls.__name__ for cls in type(sub).__mro__}
        if "WanTransformer3DModel" in names and getattr(sub, "config", None) is not None:
            return sub.config
    return None

"""The batch of the ``packed`` schedule: one pack of samples of any shapes (the packed batch contract).

The bucketed contract (:func:`~.collate.collate`) stacks samples of one shape; a pack cannot be
stacked, so its latents stay a list and the offsets of each sample in the packed token sequence travel
with it. ``docs/data_path.md`` ("Packed batches") documents every key. Text keeps the bucketed layout
(zero padded per sample, with a mask), plus each sample's own length and offsets for varlen kernels.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_adaptiveload.loading.collate import int_tensor, pad_texts, sample_fields
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.sizing import tokens_per_sample

__all__ = ["collate_packed"]


def collate_packed(
    samples: Sequence[Mapping[str, Any]],
    patch_size: Sequence[int] = (1, 2, 2),
    cost_model: CostModel | None = None,
    global_tokens: int = -1,
    text_pad_to: int | None = None,
) -> dict[str, Any]:
    """Collate one pack: samples of any latent shapes (one channel count C).

    Args:
        samples: decoded samples as for :func:`~.collate.collate`.
        patch_size: (pt, ph, pw) for the token counts.
        cost_model: for ``"cost"`` (``c0 + sum cost(S_i)``); :meth:`CostModel.default` when None.
        global_tokens: tokens of this step summed over all ranks, or -1.
        text_pad_to: pad every pack's text to this many states (None: the longest text of the pack).

    Returns:
        ``{"packed": True, "latents": list of N Tensors (C, T_i, H_i, W_i), "latent_shapes": int64 (N, 4),
        "seq_lens": int64 (N,), "cu_seqlens": int32 (N + 1,), "text": (N, L_max, D) | None, "text_mask":
        bool (N, L_max) | None, "text_lens": int64 (N,), "text_cu_seqlens": int32 (N + 1,), "keys", "meta",
        "seq_len": the longest S_i, "batch_size": N, "num_tokens": sum S_i, "token_sq_sum": sum S_i^2, "cost": float,
        "global_tokens": int}``. Per-sample timesteps are drawn by the training step, one per sample.

    Raises:
        ValueError: empty input, differing channel counts or text widths (names the keys).
    """
    if not samples:
        raise ValueError("collate_packed needs at least one sample")
    # One place normalises the sample formats (iter_shard's dicts, webdataset's): sample_fields.
    fields = [sample_fields(s) for s in samples]
    keys = [f[0] for f in fields]
    latents = [f[1] for f in fields]
    channels = {int(x.shape[0]) for x in latents}
    if len(channels) != 1:
        raise ValueError(
            "collate_packed: a pack holds latents of one channel count C (one VAE); got "
            + ", ".join(f"{k!r}: {list(x.shape)}" for k, x in zip(keys, latents))
        )
    dtype = torch.float16 if all(x.dtype == torch.float16 for x in latents) else torch.float32
    latents = [x if x.dtype == dtype else x.to(dtype) for x in latents]
    seq_lens = [tokens_per_sample(tuple(x.shape), patch_size) for x in latents]
    texts = [f[2] for f in fields]
    text_lens = [0 if t is None else int(t.shape[0]) for t in texts]
    text, mask = pad_texts(keys, texts, text_pad_to, "collate_packed")
    model = cost_model if cost_model is not None else CostModel.default()
    # Sums in Python, one tensor each: a pack is small, and each torch call costs more than its work.
    return {
        "packed": True,
        "latents": latents,
        "latent_shapes": int_tensor([tuple(x.shape) for x in latents]),
        "seq_lens": int_tensor(seq_lens),
        "cu_seqlens": int_tensor([0, *itertools.accumulate(seq_lens)], np.int32),
        "text": text,
        "text_mask": mask,
        "text_lens": int_tensor(text_lens),
        "text_cu_seqlens": int_tensor([0, *itertools.accumulate(text_lens)], np.int32),
        "keys": keys,
        "meta": [f[3] for f in fields],
        "seq_len": max(seq_lens),
        "batch_size": len(samples),
        "num_tokens": int(sum(seq_lens)),
        "token_sq_sum": int(sum(s * s for s in seq_lens)),
        "cost": float(model.pack_cost(seq_lens)),
        "global_tokens": int(global_tokens),
    }

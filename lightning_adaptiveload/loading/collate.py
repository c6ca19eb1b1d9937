"""The batch of the bucketed schedules: samples of one latent shape stacked into the batch dict of the
contract (``docs/data_path.md``). :func:`sample_fields` reads a decoded sample (``iter_shard``'s dict or
webdataset's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.sizing import tokens_per_sample

__all__ = ["collate", "int_tensor", "pad_texts", "sample_fields"]


def sample_fields(sample: Mapping[str, Any]) -> tuple[str, torch.Tensor, Any, Any, Any]:
    """(key, latent, text, meta, ref) of a decoded sample: ``iter_shard``'s dict or webdataset's."""
    key = str(sample.get("__key__", "?"))
    latent = sample.get("latent")
    if latent is None:
        latent = sample.get("latent.npy")
    if latent is None:
        raise ValueError(f"sample {key!r} has no 'latent' (or 'latent.npy') entry; keys: {sorted(sample)}")
    if isinstance(latent, np.ndarray):
        latent = torch.from_numpy(latent)
    text = sample.get("text", sample.get("text.npy"))
    if isinstance(text, np.ndarray):
        text = torch.from_numpy(text)
    meta = sample.get("meta", sample.get("json"))
    return key, latent, text, meta, sample.get("__ref__")


def collate(
    samples: Sequence[Mapping[str, Any]],
    patch_size: Sequence[int] = (1, 2, 2),
    cost_model: CostModel | None = None,
    global_tokens: int = -1,
    text_pad_to: int | None = None,
) -> dict[str, Any]:
    """Stack samples of one latent shape into the batch dict of the contract.

    Args:
        samples: decoded samples, each ``{"__key__", "latent": Tensor (C, T, H, W), "text": Tensor (L, D)
            | None, "meta": dict | None}`` (webdataset's ``"latent.npy"`` / ``"text.npy"`` / ``"json"``
            keys and NumPy arrays are accepted too). All latents must have the same shape.
        patch_size: (pt, ph, pw) for the token count.
        cost_model: for ``"cost"``; the default cost model (:meth:`CostModel.default`) when None.
        global_tokens: sum of ``num_tokens`` over all ranks at this step, or -1 when unknown.
        text_pad_to: pad every batch's text to this many states L (for models without a text mask, and
            for one text shape under ``torch.compile``); None: the longest text of the batch.

    Returns:
        ``{"latents": Tensor (B, C, T, H, W) (float16 if every latent is, else float32), "text": Tensor
        (B, L_max, D_text) | None (zero padded), "text_mask": BoolTensor (B, L_max) | None (True on real
        states), "keys": list[str], "meta": list[dict | None], "seq_len": S, "batch_size": B,
        "num_tokens": B * S, "cost": float, "global_tokens": int}``. A sample without text gets an all-False
        mask row; ``text`` is None when no sample has text.

    Raises:
        ValueError: empty input, differing latent shapes, differing text widths D, or a text longer than
            ``text_pad_to`` (names the keys).
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    fields = [sample_fields(s) for s in samples]
    keys = [f[0] for f in fields]
    latents = [f[1] for f in fields]
    shape = tuple(latents[0].shape)
    for key, lat in zip(keys, latents):
        if tuple(lat.shape) != shape:
            raise ValueError(
                f"collate: sample {key!r} has latent shape {list(lat.shape)} but {keys[0]!r} has {list(shape)}; a "
                "batch holds one shape (bucket the samples first)"
            )
    dtype = torch.float16 if all(x.dtype == torch.float16 for x in latents) else torch.float32
    stacked = torch.stack([x if x.dtype == dtype else x.to(dtype) for x in latents])
    seq_len = tokens_per_sample(shape, patch_size)
    bsz = len(samples)
    text, mask = pad_texts(keys, [f[2] for f in fields], text_pad_to, "collate")
    model = cost_model if cost_model is not None else CostModel.default()
    return {
        "latents": stacked,
        "text": text,
        "text_mask": mask,
        "keys": keys,
        "meta": [f[3] for f in fields],
        "seq_len": seq_len,
        "batch_size": bsz,
        "num_tokens": bsz * seq_len,
        "cost": float(model.batch_cost(bsz, seq_len)),
        "global_tokens": int(global_tokens),
    }


def pad_texts(
    keys: Sequence[str], texts: Sequence[torch.Tensor | None], text_pad_to: int | None, who: str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(text (N, L_max, D) zero padded, mask (N, L_max) True on real states)`` of a batch's texts, or
    ``(None, None)`` where no sample has text; float16 if every text is, else float32.

    Args:
        keys: the samples' keys, for messages.
        texts: each sample's (L, D_text) states, or None.
        text_pad_to: pad to this many states (None: the longest text).
        who: the collate named in messages.

    Raises:
        ValueError: a text that is not 2-d, differing widths D_text, or a text longer than ``text_pad_to``.
    """
    present = [t for t in texts if t is not None]
    if not present:
        return None, None
    widths = {int(t.shape[-1]) for t in present}
    if len(widths) != 1 or any(t.dim() != 2 for t in present):
        raise ValueError(
            f"{who}: text states must be (L, D_text) with one D_text per batch; got "
            + ", ".join(f"{k!r}: {list(t.shape)}" for k, t in zip(keys, texts) if t is not None)
        )
    width = widths.pop()
    l_max = max(int(t.shape[0]) for t in present)
    if text_pad_to is not None:
        if l_max > int(text_pad_to):
            longest = next(k for k, t in zip(keys, texts) if t is not None and int(t.shape[0]) == l_max)
            raise ValueError(
                f"{who}: sample {longest!r} has {l_max} text states, more than text_pad_to={text_pad_to}; "
                "raise text_pad_to to the longest text of the data (or shorten the captions)"
            )
        l_max = int(text_pad_to)
    tdtype = torch.float16 if all(t.dtype == torch.float16 for t in present) else torch.float32
    rows = [None if t is None else t if t.dtype == tdtype else t.to(tdtype) for t in texts]
    if l_max and all(r is None or (r.device.type == "cpu" and not r.requires_grad) for r in rows):
        return _pad_in_bytes(rows, l_max, width, tdtype)
    text = torch.zeros((len(texts), l_max, width), dtype=tdtype)
    mask = torch.zeros((len(texts), l_max), dtype=torch.bool)
    for i, t in enumerate(rows):
        if t is not None and t.shape[0]:
            text[i, : t.shape[0]] = t
            mask[i, : t.shape[0]] = True
    return text, mask


def _pad_in_bytes(
    rows: Sequence[torch.Tensor | None], l_max: int, width: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`pad_texts` of CPU tensors, copied into one buffer by slicing. Why: a loader worker shares its
    interpreter lock with the threads that fetch its data, and every torch call lets go of the lock and
    waits to take it back; a pack of small texts would spend more on those waits than on copying. The
    tensors are made through NumPy (``torch.from_numpy`` keeps the lock) for the same reason."""
    np_dtype = np.dtype(np.float16 if dtype == torch.float16 else np.float32)
    row = width * np_dtype.itemsize
    text = bytearray(len(rows) * l_max * row)
    mask = bytearray(len(rows) * l_max)
    for i, t in enumerate(rows):
        n = 0 if t is None else int(t.shape[0])
        if n:
            src = t if t.is_contiguous() else t.contiguous()
            off = i * l_max * row
            text[off : off + n * row] = memoryview(src.numpy()).cast("B")
            mask[i * l_max : i * l_max + n] = b"\1" * n
    return (
        torch.from_numpy(np.frombuffer(text, dtype=np_dtype).reshape(len(rows), l_max, width)),
        torch.from_numpy(np.frombuffer(mask, dtype=np.bool_).reshape(len(rows), l_max)),
    )


def int_tensor(values: Sequence[Any], dtype: type = np.int64) -> torch.Tensor:
    """A CPU integer tensor of ``values`` (a list, or a list of equal-length lists), made through NumPy:
    ``torch.tensor`` lets go of the interpreter lock, which costs a loader worker a wait behind its fetch
    threads (see :func:`_pad_in_bytes`)."""
    return torch.from_numpy(np.asarray(values, dtype=dtype))

"""Load Wan 2.1 transformer weights into :class:`~lightning_adaptiveload.models.VideoDiT`.

Two folder layouts are read, both as safetensors (pickled ``.pth`` / ``.bin`` files are refused, since
unpickling runs code):

- **Wan's own** (``Wan-AI/Wan2.1-T2V-1.3B``): ``config.json`` with ``_class_name: "WanModel"`` and Wan's
  field names (``dim``, ``num_heads``, ``in_dim``, ...), and ``diffusion_pytorch_model.safetensors`` or
  shards listed in ``diffusion_pytorch_model.safetensors.index.json``. Its parameter names are
  ``VideoDiT``'s own, so the mapping is the identity.
- **diffusers'** (``WanTransformer3DModel.save_pretrained``, ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers/transformer``):
  ``config.json`` with ``_class_name: "WanTransformer3DModel"`` and the same weights under other names,
  mapped key by key by :func:`diffusers_to_wan_key`.

Loading is strict: every parameter of the model must come from the checkpoint with the same shape and the
checkpoint may hold nothing else; the error names each offending tensor. Only the text-to-video
architecture is supported: image-conditioned checkpoints (I2V / FLF2V, with ``img_emb`` / ``add_k_proj``
tensors) are refused by name.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

__all__ = [
    "PretrainedError",
    "config_from_folder",
    "diffusers_to_wan_key",
    "load_pretrained",
    "read_checkpoint",
    "wan_state_dict",
]

CONFIG_NAME = "config.json"

# diffusers name fragment -> Wan name fragment. Applied to whole dotted components (see
# diffusers_to_wan_key); the order matters only in that longer prefixes come first.
_TOP_LEVEL = {
    "condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
    "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
    "condition_embedder.time_proj.": "time_projection.1.",
    "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
    "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
    "proj_out.": "head.head.",
    "patch_embedding.": "patch_embedding.",
}
_IN_BLOCK = {
    "attn1.to_q.": "self_attn.q.",
    "attn1.to_k.": "self_attn.k.",
    "attn1.to_v.": "self_attn.v.",
    "attn1.to_out.0.": "self_attn.o.",
    "attn1.norm_q.": "self_attn.norm_q.",
    "attn1.norm_k.": "self_attn.norm_k.",
    "attn2.to_q.": "cross_attn.q.",
    "attn2.to_k.": "cross_attn.k.",
    "attn2.to_v.": "cross_attn.v.",
    "attn2.to_out.0.": "cross_attn.o.",
    "attn2.norm_q.": "cross_attn.norm_q.",
    "attn2.norm_k.": "cross_attn.norm_k.",
    # diffusers calls the affine pre-cross-attention norm "norm2"; Wan (and VideoDiT) call it "norm3".
    "norm2.": "norm3.",
    "ffn.net.0.proj.": "ffn.0.",
    "ffn.net.2.": "ffn.2.",
}
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
# Tensors of image-conditioned (I2V, FLF2V) checkpoints: named so that the error says what they are.
_IMAGE_MARKERS = ("img_emb", "image_embedder", "add_k_proj", "add_v_proj", "norm_added_k", "k_img", "v_img")


class PretrainedError(ValueError):
    """A checkpoint folder that cannot be loaded into :class:`VideoDiT` (the message says why and what to do)."""


def diffusers_to_wan_key(key: str) -> str | None:
    """Wan's (and ``VideoDiT``'s) name for a ``WanTransformer3DModel`` parameter, or None if it has none.

    Examples: ``blocks.3.attn1.to_out.0.weight`` -> ``blocks.3.self_attn.o.weight``;
    ``condition_embedder.time_proj.bias`` -> ``time_projection.1.bias``; ``scale_shift_table`` ->
    ``head.modulation``; ``blocks.0.scale_shift_table`` -> ``blocks.0.modulation``.
    """
    if key == "scale_shift_table":
        return "head.modulation"
    m = _BLOCK.fullmatch(key)
    if m is not None:
        index, rest = m.groups()
        if rest == "scale_shift_table":
            return f"blocks.{index}.modulation"
        for old, new in _IN_BLOCK.items():
            if rest.startswith(old) and rest.count(".") == old.count("."):
                return f"blocks.{index}.{new}{rest[len(old) :]}"
        return None
    for old, new in _TOP_LEVEL.items():
        if key.startswith(old) and key.count(".") == old.count("."):
            return new + key[len(old) :]
    return None


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise PretrainedError(f"{path}: not valid JSON ({err}); re-download or fix the file") from None


def _layout_of_config(raw: Mapping[str, Any], path: str) -> str:
    name = raw.get("_class_name")
    if name == "WanTransformer3DModel" or "num_attention_heads" in raw:
        return "diffusers"
    if name == "WanModel" or "num_heads" in raw:
        return "wan"
    raise PretrainedError(
        f"{path}: _class_name={name!r} is neither Wan's 'WanModel' nor diffusers' 'WanTransformer3DModel' "
        "and the fields name neither layout; point init_from at a Wan 2.1 transformer folder"
    )


def config_from_folder(path: str | os.PathLike, **overrides: Any) -> VideoDiTConfig | None:
    """The :class:`VideoDiTConfig` described by ``<path>/config.json``, or None when there is none.

    Both Wan's field names (``dim``, ``num_heads``, ``in_dim``, ``out_dim``, ...) and diffusers'
    (``num_attention_heads`` x ``attention_head_dim``, ``in_channels``, ...) are understood.

    Args:
        path: the checkpoint folder.
        **overrides: fields of :class:`VideoDiTConfig` to replace afterwards.

    Raises:
        PretrainedError: the config describes an architecture ``VideoDiT`` does not implement (image
            conditioning, windowed attention), naming the field.
    """
    file = os.path.join(os.fspath(path), CONFIG_NAME)
    if not os.path.isfile(file):
        return None
    raw = _read_json(file)
    if not isinstance(raw, dict):
        raise PretrainedError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    layout = _layout_of_config(raw, file)
    fields: dict[str, Any] = {}
    if layout == "diffusers":
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if raw.get(key) is not None:
                raise PretrainedError(
                    f"{file}: {key}={raw[key]!r} marks an image-conditioned Wan model; VideoDiT implements "
                    "the text-to-video architecture only"
                )
        if "num_attention_heads" in raw and "attention_head_dim" in raw:
            fields["dim"] = int(raw["num_attention_heads"]) * int(raw["attention_head_dim"])
        names = {
            "num_heads": "num_attention_heads",
            "num_layers": "num_layers",
            "ffn_dim": "ffn_dim",
            "in_channels": "in_channels",
            "out_channels": "out_channels",
            "patch_size": "patch_size",
            "text_dim": "text_dim",
            "freq_dim": "freq_dim",
            "eps": "eps",
            "cross_attn_norm": "cross_attn_norm",
        }
        if "qk_norm" in raw:
            fields["qk_norm"] = raw["qk_norm"] is not None and raw["qk_norm"] is not False
    else:
        model_type = raw.get("model_type", "t2v")
        if model_type not in ("t2v", "ti2v"):
            raise PretrainedError(
                f"{file}: model_type={model_type!r}; VideoDiT implements the text-to-video architecture "
                "('t2v', also used by Wan 2.2 'ti2v') only"
            )
        window = raw.get("window_size", [-1, -1])
        if list(window) != [-1, -1]:
            raise PretrainedError(
                f"{file}: window_size={window!r}; VideoDiT implements global attention only ([-1, -1])"
            )
        names = {
            "dim": "dim",
            "num_heads": "num_heads",
            "num_layers": "num_layers",
            "ffn_dim": "ffn_dim",
            "in_channels": "in_dim",
            "out_channels": "out_dim",
            "patch_size": "patch_size",
            "text_dim": "text_dim",
            "freq_dim": "freq_dim",
            "eps": "eps",
            "qk_norm": "qk_norm",
            "cross_attn_norm": "cross_attn_norm",
        }
    for ours, theirs in names.items():
        if theirs in raw and raw[theirs] is not None:
            fields[ours] = raw[theirs]
    if fields.get("out_channels") is None and "in_channels" in fields:
        fields["out_channels"] = fields["in_channels"]
    fields.update(overrides)
    try:
        return VideoDiTConfig(**fields)
    except (TypeError, ValueError) as err:
        raise PretrainedError(f"{file}: the config does not make a valid VideoDiTConfig: {err}") from None


def _weight_files(folder: str) -> list[str]:
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        raise PretrainedError(
            f"{folder} holds several shard indexes {indexes}; keep the one of the transformer weights"
        )
    if indexes:
        index_path = os.path.join(folder, indexes[0])
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise PretrainedError(f"{index_path}: no 'weight_map' object; re-download the index file")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise PretrainedError(
                f"{index_path} lists shard file(s) {missing[:3]} that are not in {folder}; download them"
            )
        return [os.path.join(folder, f) for f in files]
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        pickles = [n for n in names if n.endswith((".pth", ".pt", ".bin", ".ckpt"))]
        hint = (
            f" (found {pickles[:3]}: pickled checkpoints are not loaded, since unpickling runs code; convert "
            "them to safetensors with safetensors.torch.save_file)"
            if pickles
            else ""
        )
        raise PretrainedError(f"{folder} holds no .safetensors weights{hint}")
    if len(files) > 1:
        raise PretrainedError(
            f"{folder} holds several .safetensors files {files[:4]} but no *.safetensors.index.json saying "
            "which make up the model; add the index or keep one file"
        )
    return [os.path.join(folder, files[0])]


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (or a single ``.safetensors`` file), as saved, on the CPU.

    Raises:
        PretrainedError: no weights, a shard missing, or a tensor name present in two shards.
    """
    try:
        from safetensors.torch import load_file
    except ModuleNotFoundError:  # pragma: no cover - safetensors ships with the base install
        raise PretrainedError("reading checkpoints needs safetensors: pip install safetensors") from None
    path = os.fspath(path)
    if os.path.isdir(path):
        files = _weight_files(path)
    elif os.path.isfile(path) and path.endswith(".safetensors"):
        files = [path]
    else:
        raise PretrainedError(f"{path}: not a folder or a .safetensors file; give the checkpoint folder")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in files:
        for key, value in load_file(file, device="cpu").items():
            if key in tensors:
                raise PretrainedError(f"tensor {key!r} is in both {origin[key]} and {file}; fix the shards")
            tensors[key] = value
            origin[key] = file
    return tensors


def _detect_layout(tensors: Mapping[str, torch.Tensor], config_layout: str | None) -> str:
    if any(k.startswith("condition_embedder.") or ".attn1." in k for k in tensors):
        return "diffusers"
    if any(k.startswith("time_embedding.") or ".self_attn." in k for k in tensors):
        return "wan"
    return config_layout or "wan"


def wan_state_dict(tensors: Mapping[str, torch.Tensor], layout: str | None = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under ``VideoDiT``'s (= Wan's) parameter names.

    Args:
        tensors: as read by :func:`read_checkpoint`.
        layout: ``"wan"``, ``"diffusers"`` or None to tell from the names.

    Raises:
        PretrainedError: naming every tensor with no ``VideoDiT`` counterpart.
    """
    layout = layout or _detect_layout(tensors, None)
    if layout == "wan":
        out = dict(tensors)
        unknown = [k for k in out if any(m in k for m in _IMAGE_MARKERS)]
    elif layout == "diffusers":
        out, unknown = {}, []
        for key, value in tensors.items():
            new = diffusers_to_wan_key(key)
            if new is None:
                unknown.append(key)
            else:
                out[new] = value
    else:
        raise ValueError(f"layout must be 'wan', 'diffusers' or None, got {layout!r}")
    image = [k for k in unknown if any(m in k for m in _IMAGE_MARKERS)]
    if image:
        raise PretrainedError(
            f"checkpoint holds image-conditioning tensors ({image[:3]}{'...' if len(image) > 3 else ''}, "
            f"{len(image)} in all): an I2V/FLF2V model; VideoDiT implements the text-to-video architecture only"
        )
    if unknown:
        raise PretrainedError(
            f"{len(unknown)} {layout}-layout tensor(s) have no VideoDiT counterpart: {unknown[:5]}"
            f"{'...' if len(unknown) > 5 else ''}; is this a Wan 2.1 T2V transformer checkpoint?"
        )
    return out


def load_pretrained(model: VideoDiT, path: str | os.PathLike) -> VideoDiT:
    """Copy a Wan 2.1 checkpoint folder's weights into ``model``, strictly; returns ``model``.

    The tensors are cast to each parameter's dtype and copied to its device. A model on the meta device
    (built for FSDP) gets the checkpoint's tensors assigned instead. A model sharded with FSDP2 takes them
    through :func:`~lightning_adaptiveload.models.sharding.load_full_state_dict` instead (with the state of
    :func:`pretrained_state_dict`).

    Raises:
        PretrainedError: listing the missing tensors, the unexpected ones and those whose shapes differ
            (with both shapes); nothing is copied then.
    """
    state = pretrained_state_dict(model, path)
    own = model.state_dict()
    meta = any(p.is_meta for p in model.parameters())
    if meta:
        cast = {k: state[k].to(own[k].dtype) for k in own}
        model.load_state_dict(cast, strict=True, assign=True)
    else:
        with torch.no_grad():
            model.load_state_dict(state, strict=True)
    return model


def pretrained_state_dict(model: VideoDiT, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict of a Wan 2.1 checkpoint folder in ``model``'s names, checked against ``model``.

    ``model`` may be on the meta device or sharded (its state dict then holds DTensors, whose shapes are
    the full ones): only names and shapes are compared.

    Raises:
        PretrainedError: as :func:`load_pretrained`.
    """
    path = os.fspath(path)
    config_file = os.path.join(path, CONFIG_NAME)
    config_layout = (
        _layout_of_config(_read_json(config_file), config_file) if os.path.isfile(config_file) else None
    )
    tensors = read_checkpoint(path)
    state = wan_state_dict(tensors, _detect_layout(tensors, config_layout))
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    mis_shaped = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(state))
        if tuple(state[k].shape) != tuple(own[k].shape)
    ]
    problems = []
    if missing:
        problems.append(
            f"missing from the checkpoint ({len(missing)}): {missing[:6]}{'...' if len(missing) > 6 else ''}"
        )
    if unexpected:
        problems.append(
            f"not in the model ({len(unexpected)}): {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}"
        )
    if mis_shaped:
        problems.append(
            f"shape mismatch ({len(mis_shaped)}): {mis_shaped[:6]}{'...' if len(mis_shaped) > 6 else ''}"
        )
    if problems:
        raise PretrainedError(
            f"{path} does not fit the model ({model.config.num_layers} blocks, dim {model.config.dim}): "
            + "; ".join(problems)
            + ". Build the model from the folder's config (VideoDiT.from_pretrained) or fix the overrides"
        )
    return state


def from_pretrained(
    path: str | os.PathLike, config: VideoDiTConfig | None = None, **overrides: Any
) -> VideoDiT:
    """A :class:`VideoDiT` built from ``<path>/config.json`` (or ``config``) with the folder's weights.

    Args:
        path: a Wan 2.1 transformer folder in Wan's or diffusers' layout (see the module docstring).
        config: the configuration to use when the folder has no ``config.json``; with one, its fields win
            unless overridden.
        **overrides: fields of :class:`VideoDiTConfig` to replace (non-architectural ones, such as
            ``eps``; architectural ones make loading fail by name).

    Raises:
        PretrainedError: no config anywhere, or the weights do not fit (see :func:`load_pretrained`).
    """
    cfg = config_from_folder(path, **overrides)
    if cfg is None:
        if config is None:
            raise PretrainedError(
                f"{os.fspath(path)} has no {CONFIG_NAME}; pass config=VideoDiTConfig.preset(...) to say "
                "which architecture the weights are"
            )
        cfg = VideoDiTConfig(**{**config.__dict__, **overrides})
    return load_pretrained(VideoDiT(cfg), path)

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

A downloaded folder is untrusted input (threat model: ``docs/reliability.md``): ``config.json`` and the
shard index are read with a size and nesting cap, every config value is type- and range-checked with the
file named, and the model the config describes must fit in the bytes of the weight files (a
``num_layers: 10**7`` would otherwise build for half a minute and run out of memory); shard files named
by ``weight_map`` must lie inside the folder, every one of them checked before any file is opened; each
weight file's safetensors header is checked (length, JSON, every tensor's byte range within the file) before
the config is compared with the weights' size, so that a corrupt file is reported as corrupt, with its rule;
tensors must be float32, bfloat16 or float16, finite, and representable in the model's dtype: nothing is cast
silently.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from lightning_adaptiveload.models.config import VideoDiTConfig

# A VideoDiT (not imported: models/video_dit.py imports this module for ``VideoDiT.from_pretrained``).
VideoDiT = TypeVar("VideoDiT", bound=torch.nn.Module)

__all__ = [
    "PretrainedError",
    "config_from_folder",
    "diffusers_to_wan_key",
    "load_pretrained",
    "read_checkpoint",
    "wan_state_dict",
]

CONFIG_NAME = "config.json"
MAX_JSON_BYTES = 1 << 24  # config.json and the shard index (a 14B model's index is ~100 KiB)
# Dtypes a checkpoint tensor may have; each casts into a float model without surprise (float64 would
# overflow bf16 / fp16: 1e300 became inf; integers and bools are not weights).
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# (low, high) of each integer config value, by VideoDiTConfig field; far beyond any published model
# (Wan 14B: dim 5120, 40 layers, 40 heads, ffn 13824).
_INT_RANGES = {
    "dim": (1, 1 << 16),
    "num_heads": (1, 1 << 10),
    "num_layers": (1, 1 << 10),
    "ffn_dim": (1, 1 << 18),
    "in_channels": (1, 1 << 10),
    "out_channels": (1, 1 << 10),
    "text_dim": (1, 1 << 16),
    "freq_dim": (2, 1 << 16),
    "text_len": (1, 1 << 16),
}
_MIN_BYTES_PER_PARAMETER = 2  # bf16 / fp16, the narrowest dtype of WEIGHT_DTYPES
# A safetensors header: an 8-byte little-endian length, then that many bytes of JSON (safetensors' own cap).
MAX_SAFETENSORS_HEADER = 100_000_000
_SAFETENSORS_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
    "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip

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


class _NoWeights(PretrainedError):
    """The folder holds no weight file at all (a config alone is still readable)."""


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
    """A JSON file of the folder, read as untrusted: a regular file, at most MAX_JSON_BYTES, nesting
    bounded (200,000 levels gave RecursionError), no NaN / Infinity."""
    from lightning_adaptiveload.shards.paths import open_regular
    from lightning_adaptiveload.shards.untrusted import Refused, load_json

    try:
        with open_regular(path) as f:
            raw = f.read(MAX_JSON_BYTES + 1)
    except OSError as err:
        raise PretrainedError(f"{path}: cannot read it ({err})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise PretrainedError(
            f"{path}: larger than {MAX_JSON_BYTES} bytes; not a model's JSON file: re-download it"
        )
    try:
        return load_json(raw)
    except Refused as err:
        raise PretrainedError(
            f"{path}: not valid JSON: the file {err}; re-download or fix the file"
        ) from None


def _check_config_values(raw: Mapping[str, Any], file: str, names: Mapping[str, str]) -> None:
    """Type and range of every value the config gives (by its name in the file), before any is used."""

    def bad(name: str, value: Any, rule: str) -> PretrainedError:
        text = repr(value)
        text = text if len(text) <= 60 else text[:57] + "..."
        return PretrainedError(f"{file}: {name}={text} {rule}; fix the value or re-download the config")

    for ours, theirs in names.items():
        value = raw.get(theirs)
        if value is None:
            continue
        if ours in _INT_RANGES:
            lo, hi = _INT_RANGES[ours]
            if type(value) is not int or not lo <= value <= hi:
                raise bad(theirs, value, f"must be an integer in [{lo}, {hi}]")
        elif ours == "patch_size":
            if not (
                isinstance(value, list)
                and len(value) == 3
                and all(type(p) is int and 1 <= p <= 64 for p in value)
            ):
                raise bad(theirs, value, "must be a list of 3 integers in [1, 64]")
        elif ours == "eps":
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not (math.isfinite(value) and 0 < value < 1)
            ):
                raise bad(theirs, value, "must be a finite number in (0, 1)")
        elif ours in ("qk_norm", "cross_attn_norm") and not isinstance(value, bool | str):
            raise bad(theirs, value, "must be true, false or a norm's name")
    for name in ("attention_head_dim",):
        value = raw.get(name)
        if value is not None and (type(value) is not int or not 1 <= value <= 1 << 12):
            raise bad(name, value, f"must be an integer in [1, {1 << 12}]")


def _parameters_at_least(cfg: VideoDiTConfig) -> int:
    """A lower bound of the model's parameter count: every block's attention (self and cross, q k v o of
    dim x dim) and FFN (two dim x ffn_dim matrices)."""
    return cfg.num_layers * (8 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.ffn_dim)


def _check_fits_weights(cfg: VideoDiTConfig, file: str, folder: str) -> None:
    """The model the config describes must fit in the folder's weight files (when it has some).

    The weight files are checked first (every path, then each file's header), so that a bad shard path or a
    corrupt file is reported as such, not as a config that does not describe the weights.
    """
    try:
        files = _weight_files(folder)
    except _NoWeights:
        return  # no weights here: loading them, later, says what is missing
    for f in files:
        _check_safetensors_header(f)
    available = sum(os.path.getsize(f) for f in files)
    need = _parameters_at_least(cfg) * _MIN_BYTES_PER_PARAMETER
    if need > available:
        raise PretrainedError(
            f"{file}: describes a model of at least {_parameters_at_least(cfg):,} parameters ({cfg.num_layers} "
            f"blocks of width {cfg.dim}, ffn {cfg.ffn_dim}), {need:,} bytes in half precision, but the weight "
            f"files of {folder} hold {available:,} bytes: the config does not describe these weights; fix "
            "num_layers / dim / ffn_dim or re-download the config"
        )


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
    names: dict[str, str]
    if layout == "diffusers":
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if raw.get(key) is not None:
                raise PretrainedError(
                    f"{file}: {key}={raw[key]!r} marks an image-conditioned Wan model; VideoDiT implements "
                    "the text-to-video architecture only"
                )
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
        _check_config_values(raw, file, {**names, "qk_norm": "qk_norm"})
        if raw.get("num_attention_heads") is not None and raw.get("attention_head_dim") is not None:
            fields["dim"] = raw["num_attention_heads"] * raw["attention_head_dim"]
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
        if window != [-1, -1] and window != (-1, -1):
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
            "text_len": "text_len",
        }
        _check_config_values(raw, file, names)
    for ours, theirs in names.items():
        if theirs in raw and raw[theirs] is not None:
            fields[ours] = raw[theirs]
    # Wan pads every prompt to 512 umT5 tokens (diffusers' pipelines too, max_sequence_length=512; its
    # config does not say so): one key length for the cross-attention (VideoDiTConfig.text_len).
    fields.setdefault("text_len", 512)
    if fields.get("out_channels") is None and "in_channels" in fields:
        fields["out_channels"] = fields["in_channels"]
    if "dim" in fields and not 1 <= fields["dim"] <= _INT_RANGES["dim"][1]:
        raise PretrainedError(
            f"{file}: num_attention_heads x attention_head_dim = {fields['dim']} is over {_INT_RANGES['dim'][1]}"
        )
    fields.update(overrides)
    try:
        cfg = VideoDiTConfig(**fields)
    except (TypeError, ValueError) as err:
        raise PretrainedError(f"{file}: the config does not make a valid VideoDiTConfig: {err}") from None
    _check_fits_weights(cfg, file, os.fspath(path))
    return cfg


def _weight_files(folder: str) -> list[str]:
    """The folder's weight files, every path checked (:func:`_shard_name`) and each a regular file, before any
    is opened: nothing outside the folder is opened, whatever the index names."""
    names = sorted(os.listdir(folder))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        raise PretrainedError(
            f"{folder} holds several shard indexes {indexes}; keep the one of the transformer weights"
        )
    if indexes:
        index_path = os.path.join(folder, indexes[0])
        data = _read_json(index_path)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise PretrainedError(f"{index_path}: no 'weight_map' object; re-download the index file")
        files = sorted({_shard_name(index_path, folder, k, v) for k, v in weight_map.items()})
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise PretrainedError(
                f"{index_path} lists shard file(s) {missing[:3]} that are not in {folder}; download them"
            )
        return [_regular(os.path.join(folder, f)) for f in files]
    files = [n for n in names if n.endswith(".safetensors")]
    if not files:
        pickles = [n for n in names if n.endswith((".pth", ".pt", ".bin", ".ckpt"))]
        hint = (
            f" (found {pickles[:3]}: pickled checkpoints are not loaded, since unpickling runs code; convert "
            "them to safetensors with safetensors.torch.save_file)"
            if pickles
            else ""
        )
        raise _NoWeights(f"{folder} holds no .safetensors weights{hint}")
    if len(files) > 1:
        raise PretrainedError(
            f"{folder} holds several .safetensors files {files[:4]} but no *.safetensors.index.json saying "
            "which make up the model; add the index or keep one file"
        )
    return [_regular(os.path.join(folder, files[0]))]


def _regular(file: str) -> str:
    """``file``, if it is a regular file (a symbolic link to one is followed); a stat, nothing is opened."""
    try:
        mode = os.stat(file).st_mode
    except OSError as err:
        raise PretrainedError(f"{file}: cannot read it ({err})") from None
    if not stat.S_ISREG(mode):
        raise PretrainedError(f"{file}: not a regular file (a FIFO, device or directory); give a weight file")
    return file


def _corrupt(file: str, rule: str) -> PretrainedError:
    return PretrainedError(
        f"{file}: not a readable safetensors file, corrupt: {rule}; re-download it (or re-save it with "
        "safetensors.torch.save_file)"
    )


def _check_safetensors_header(file: str) -> None:
    """The safetensors header of ``file``, checked without reading its tensors: the 8-byte length fits the
    file and :data:`MAX_SAFETENSORS_HEADER`, the header is a JSON object, and every tensor has a dtype, a
    shape and byte offsets that lie inside the file's data and match its dtype and shape.

    Raises:
        PretrainedError: naming the file and the rule it breaks.
    """
    from lightning_adaptiveload.shards.paths import open_regular
    from lightning_adaptiveload.shards.untrusted import Refused, load_json

    try:
        size = os.stat(file).st_size
        with open_regular(file) as f:
            head = f.read(8)
            if len(head) < 8:
                raise _corrupt(file, f"{len(head)} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise _corrupt(
                    file,
                    f"its header length says {n:,} bytes but the file holds {size:,}: truncated, or not "
                    "a safetensors file",
                )
            if n > MAX_SAFETENSORS_HEADER:
                raise _corrupt(file, f"a header of {n:,} bytes, over safetensors' {MAX_SAFETENSORS_HEADER:,}")
            raw = f.read(n)
    except OSError as err:
        raise PretrainedError(f"{file}: cannot read it ({err})") from None
    try:
        header = load_json(raw)
    except Refused as err:
        raise _corrupt(file, f"its header {err}") from None
    if not isinstance(header, dict):
        raise _corrupt(file, f"its header is a JSON {type(header).__name__}, not an object")
    data = size - 8 - n  # the bytes of the tensors
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {str(name)[:80]!r}"
        if not isinstance(entry, dict):
            raise _corrupt(file, f"{where} is described by a {type(entry).__name__}, not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise _corrupt(file, f"{where} has no dtype")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _corrupt(file, f"{where} has shape {str(shape)[:60]}, not a list of sizes >= 0")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise _corrupt(
                file, f"{where} has data_offsets {str(offsets)[:60]}, not [begin, end] with begin <= end"
            )
        if offsets[1] > data:
            raise _corrupt(
                file,
                f"{where} ends at byte {offsets[1]:,} of a {data:,}-byte data section: the file is truncated",
            )
        width = _SAFETENSORS_DTYPE_BYTES.get(dtype)
        if width is not None and offsets[1] - offsets[0] != math.prod(shape) * width:
            raise _corrupt(
                file,
                f"{where} ({dtype}, shape {shape}) needs {math.prod(shape) * width:,} bytes but its offsets "
                f"span {offsets[1] - offsets[0]:,}",
            )


def _shard_name(index_path: str, folder: str, tensor: Any, name: Any) -> str:
    """A ``weight_map`` entry, checked: a relative ``.safetensors`` path that stays inside the folder.

    Decided on the path as written (``../../outside/w.safetensors`` and absolute paths are refused); a
    symbolic link inside the folder is followed (the Hugging Face cache links every file to a blob).
    """
    where = f"{index_path}: weight_map[{str(tensor)[:80]!r}] = {str(name)[:120]!r}"
    if not isinstance(name, str) or not name or "\x00" in name:
        raise PretrainedError(f"{where} is not a file name; re-download the index file")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"[A-Za-z]:", name):
        raise PretrainedError(f"{where} is an absolute path; shard files must be inside {folder}")
    target = os.path.normpath(os.path.join(folder, name))
    if os.path.commonpath([target, os.path.normpath(folder)]) != os.path.normpath(folder):
        raise PretrainedError(f"{where} climbs out of {folder}; shard files must be inside the folder")
    if not name.endswith(".safetensors"):
        raise PretrainedError(f"{where} is not a .safetensors file (pickled checkpoints are never loaded)")
    return name


def _load_safetensors(file: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    _check_safetensors_header(_regular(file))
    try:
        return load_file(file, device="cpu")
    except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
        raise PretrainedError(
            f"{file}: not a readable safetensors file ({type(err).__name__}: {err}); re-download it"
        ) from None


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder (or a single ``.safetensors`` file), as saved, on the CPU.

    Raises:
        PretrainedError: no weights, a shard missing or outside the folder, a file that is not valid
            safetensors (named), or a tensor name present in two shards.
    """
    try:
        import safetensors.torch  # noqa: F401
    except ModuleNotFoundError:  # pragma: no cover - safetensors ships with the base install
        raise PretrainedError("reading checkpoints needs safetensors: pip install safetensors") from None
    path = os.fspath(path)
    if os.path.isdir(path):
        files = _weight_files(path)  # every path checked before any file is opened
    elif os.path.isfile(path) and path.endswith(".safetensors"):
        files = [path]
    else:
        raise PretrainedError(f"{path}: not a folder or a .safetensors file; give the checkpoint folder")
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for file in files:
        for key, value in _load_safetensors(file).items():
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
    problems = _dtype_problems(state, own)
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


def _dtype_problems(state: Mapping[str, torch.Tensor], own: Mapping[str, Any]) -> list[str]:
    """Tensors that would change when cast into the model: a dtype not in WEIGHT_DTYPES, a value that
    is NaN or Inf, or one beyond the model dtype's range. Nothing is cast silently."""
    bad_dtype, non_finite, out_of_range = [], [], []
    for k in sorted(state):
        t = state[k]
        if t.dtype not in WEIGHT_DTYPES:
            bad_dtype.append(f"{k}: {str(t.dtype).removeprefix('torch.')}")
            continue
        if t.numel() == 0 or k not in own:
            continue
        if not bool(torch.isfinite(t).all()):
            non_finite.append(k)
            continue
        target = getattr(own[k], "dtype", t.dtype)
        if target.is_floating_point and torch.finfo(target).max < torch.finfo(t.dtype).max:
            if float(t.abs().max()) > torch.finfo(target).max:
                out_of_range.append(
                    f"{k}: |x| up to {float(t.abs().max()):.3g}, {target} holds {torch.finfo(target).max:.3g}"
                )
    problems = []
    if bad_dtype:
        problems.append(
            f"tensors of a dtype other than float32/bfloat16/float16 ({len(bad_dtype)}): {bad_dtype[:6]}"
            f"{'...' if len(bad_dtype) > 6 else ''}; weights are never cast from it silently: convert the checkpoint"
        )
    if non_finite:
        problems.append(
            f"tensors holding NaN or Inf ({len(non_finite)}): {non_finite[:6]}{'...' if len(non_finite) > 6 else ''}"
        )
    if out_of_range:
        problems.append(f"values beyond the model's dtype ({len(out_of_range)}): {out_of_range[:3]}")
    return problems

"""A downloaded checkpoint folder as untrusted input (issue 42): shard paths, config values, dtypes, corrupt
files. Each case is a ``PretrainedError`` naming the file, the key and the rule, in bounded time and memory;
nothing outside the folder is opened. Plus a fuzz of mutated ``config.json`` files and weight maps."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import time

import pytest
import torch

from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig
from lightning_adaptiveload.models import pretrained as pre
from lightning_adaptiveload.models.pretrained import PretrainedError, config_from_folder, load_pretrained

safetensors_torch = pytest.importorskip("safetensors.torch")

WEIGHTS = "diffusion_pytorch_model.safetensors"
CFG = VideoDiTConfig.preset("tiny", num_layers=1)
WAN_CONFIG = {
    "_class_name": "WanModel",
    "model_type": "t2v",
    "dim": CFG.dim,
    "num_heads": CFG.num_heads,
    "num_layers": CFG.num_layers,
    "ffn_dim": CFG.ffn_dim,
    "in_dim": CFG.in_channels,
    "out_dim": CFG.out_channels,
    "text_dim": CFG.text_dim,
    "freq_dim": CFG.freq_dim,
    "eps": 1e-6,
    "patch_size": [1, 2, 2],
    "window_size": [-1, -1],
    "qk_norm": True,
    "cross_attn_norm": True,
}


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.contiguous() for k, v in VideoDiT(CFG).state_dict().items()}


@pytest.fixture(scope="module")
def state():
    return _state()


def _folder(path, state, config=WAN_CONFIG, sharded=False):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if sharded:
        keys = sorted(state)
        names = {"a.safetensors": keys[: len(keys) // 2], "b.safetensors": keys[len(keys) // 2 :]}
        for name, part in names.items():
            safetensors_torch.save_file({k: state[k] for k in part}, str(path / name))
        wm = {k: n for n, part in names.items() for k in part}
        (path / f"{WEIGHTS}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    else:
        safetensors_torch.save_file(state, str(path / WEIGHTS))
    return path


def test_a_valid_folder_loads(tmp_path, state):
    for sharded in (False, True):
        folder = _folder(tmp_path / str(sharded), state, sharded=sharded)
        model = VideoDiT.from_pretrained(folder)
        # A loaded Wan pads its text to Wan's 512 tokens (VideoDiTConfig.text_len), whatever the folder says.
        assert model.config == dataclasses.replace(CFG, text_len=512)
        torch.testing.assert_close(
            model.state_dict()["blocks.0.ffn.0.weight"], state["blocks.0.ffn.0.weight"]
        )


# -- shard paths ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry", ["../../outside/w.safetensors", "ABSOLUTE", "sub/../../w.safetensors", "a.pth"]
)
def test_weight_map_cannot_name_files_outside_the_folder(tmp_path, state, monkeypatch, entry):
    outside = tmp_path / "outside"
    outside.mkdir()
    safetensors_torch.save_file(state, str(outside / "w.safetensors"))  # a valid file: must never be opened
    folder = _folder(tmp_path / "a" / "b", state, sharded=True)
    index = folder / f"{WEIGHTS}.index.json"
    data = json.loads(index.read_text())
    name = str(outside / "w.safetensors") if entry == "ABSOLUTE" else entry
    data["weight_map"]["blocks.0.ffn.0.weight"] = name
    index.write_text(json.dumps(data))
    opened = []
    real = pre._load_safetensors
    monkeypatch.setattr(pre, "_load_safetensors", lambda f: opened.append(f) or real(f))
    with pytest.raises(PretrainedError) as err:
        load_pretrained(VideoDiT(CFG), folder)
    message = str(err.value)
    assert str(index) in message and "weight_map['blocks.0.ffn.0.weight']" in message, message
    assert any(w in message for w in ("climbs out of", "absolute path", "not a .safetensors file")), message
    assert not any("outside" in f for f in opened)


def _refuse_opening(monkeypatch, outside):
    """Every way a file could be opened fails loudly for a path under ``outside``; returns the weight files
    (inside or not) opened, in order."""
    import builtins
    import os

    import safetensors

    opened = []

    def guard(real, name):
        def wrapper(file, *args, **kwargs):
            path = os.fspath(file) if isinstance(file, str | os.PathLike) else str(file)
            if path.endswith(".safetensors"):
                opened.append(path)
            if str(outside) in os.path.realpath(path) if isinstance(file, str | os.PathLike) else False:
                raise AssertionError(f"{name} opened {path}, outside the folder")
            return real(file, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(builtins, "open", guard(builtins.open, "open"))
    monkeypatch.setattr(os, "open", guard(os.open, "os.open"))
    monkeypatch.setattr(safetensors_torch, "load_file", guard(safetensors_torch.load_file, "load_file"))
    monkeypatch.setattr(safetensors, "safe_open", guard(safetensors.safe_open, "safe_open"))
    return opened


@pytest.mark.parametrize("first", [True, False])  # the bad entry before or after the good ones (sorted)
@pytest.mark.parametrize("how", ["from_pretrained", "config", "load", "read", "module"])
def test_a_weight_map_naming_outside_is_refused_before_any_weight_file_is_opened(
    tmp_path, state, monkeypatch, first, how
):
    """Issue 63: ``../../outside/w.safetensors`` was refused only after the file outside had been opened."""
    outside = tmp_path / "outside"
    outside.mkdir()
    safetensors_torch.save_file(state, str(outside / "w.safetensors"))
    folder = _folder(tmp_path / "a" / "b", state, sharded=True)
    index = folder / f"{WEIGHTS}.index.json"
    data = json.loads(index.read_text())
    key = sorted(data["weight_map"])[0 if first else -1]
    data["weight_map"][key] = "../../outside/w.safetensors"
    index.write_text(json.dumps(data))
    opened = _refuse_opening(monkeypatch, outside)
    with pytest.raises(AssertionError, match="outside the folder"):  # the guard works: the test can fail
        safetensors_torch.load_file(str(outside / "w.safetensors"))
    opened.clear()
    with pytest.raises(PretrainedError) as err:
        if how == "from_pretrained":
            VideoDiT.from_pretrained(folder)
        elif how == "config":
            config_from_folder(folder)
        elif how == "load":
            load_pretrained(VideoDiT(CFG), folder)
        elif how == "read":
            pre.read_checkpoint(folder)
        else:
            from lightning_adaptiveload.models.module import VideoDiTModule

            VideoDiTModule(init_from=str(folder))
    message = str(err.value)
    assert f"weight_map[{key!r}]" in message and "climbs out of" in message and str(index) in message, message
    assert opened == []  # every path checked before any weight file, inside or out, was opened


def _rewrite_header(path, change):
    """``change`` the JSON header of a safetensors file, its tensors' bytes kept as they are."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    change(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text = text.ljust(-(-len(text) // 8) * 8, b" ")
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def _grow_first_tensor(header):
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["shape"] = [d + 1 for d in header[name]["shape"]]


def _past_the_end(header):
    name = sorted(k for k in header if k != "__metadata__")[0]
    header[name]["data_offsets"] = [header[name]["data_offsets"][0], 10**9]


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize(
    "damage, rule",
    [
        ("truncate", "the file is truncated"),
        ("garbage", "its header length says"),
        ("header", "its header length says 1,000,000,000,000 bytes"),
        ("not json", "its header does not parse"),
        ("shape", "needs"),
        ("offsets", "ends at byte 1,000,000,000"),
        ("empty", "0 bytes, shorter than the 8-byte header length"),
    ],
)
def test_a_corrupt_safetensors_is_reported_as_corrupt_not_as_a_config_mismatch(
    tmp_path, state, sharded, damage, rule
):
    """Issue 63: a corrupt file was reported as "the config does not describe these weights" (the config's
    size check ran on the file's bytes before the file was read)."""
    folder = _folder(tmp_path / "f", state, sharded=sharded)
    path = folder / ("b.safetensors" if sharded else WEIGHTS)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    if damage == "truncate":
        path.write_bytes(raw[: 8 + n + (len(raw) - 8 - n) // 2])
    elif damage == "garbage":
        path.write_bytes(b"\xff" * 64)
    elif damage == "header":
        path.write_bytes((10**12).to_bytes(8, "little") + raw[8:])
    elif damage == "not json":
        path.write_bytes(raw[:8] + b"x" * n + raw[8 + n :])
    elif damage == "shape":
        _rewrite_header(path, _grow_first_tensor)
    elif damage == "offsets":
        _rewrite_header(path, _past_the_end)
    else:
        path.write_bytes(b"")
    for load in (VideoDiT.from_pretrained, config_from_folder, lambda f: load_pretrained(VideoDiT(CFG), f)):
        with pytest.raises(PretrainedError) as err:
            load(folder)
        message = str(err.value)
        assert message.startswith(f"{path}: not a readable safetensors file, corrupt: "), message
        assert rule in message, message
        assert "does not describe these weights" not in message


def test_a_config_too_big_for_sound_weights_is_still_a_config_mismatch(tmp_path, state):
    folder = _folder(tmp_path / "f", state)
    (folder / "config.json").write_text(json.dumps({**WAN_CONFIG, "num_layers": 1000}))
    with pytest.raises(PretrainedError, match="the config does not describe these weights"):
        VideoDiT.from_pretrained(folder)


# -- config values ---------------------------------------------------------------------------------


def _config_error(tmp_path, state, config_text: str) -> str:
    folder = _folder(tmp_path / "f", state)
    (folder / "config.json").write_text(config_text)
    t0 = time.perf_counter()
    with pytest.raises(PretrainedError) as err:
        VideoDiT.from_pretrained(folder)
    assert time.perf_counter() - t0 < 5.0
    message = str(err.value)
    assert str(folder / "config.json") in message, message
    return message


def test_config_nested_200000_deep(tmp_path, state):
    """Before: RecursionError."""
    message = _config_error(tmp_path, state, '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert "nests 200001 levels deep" in message


@pytest.mark.parametrize(
    "key, value, words",
    [
        (
            "num_layers",
            10**7,
            "num_layers=10000000 must be an integer in [1, 1024]",
        ),  # before: 35 s, MemoryError
        ("num_layers", 1000, "does not describe these weights"),  # in range, but 1000 blocks need 100 MB
        ("dim", 4096, "does not describe these weights"),
        ("num_layers", 2.0, "num_layers=2.0 must be an integer"),
        ("num_heads", True, "num_heads=True must be an integer"),
        ("eps", -1, "eps=-1 must be a finite number in (0, 1)"),
        ("eps", "1e-6", "eps='1e-6' must be a finite number"),
        ("patch_size", [1, 2], "patch_size=[1, 2] must be a list of 3 integers"),
        ("qk_norm", 5, "qk_norm=5 must be true, false or a norm's name"),
        ("window_size", 3, "window_size=3"),
    ],
)
def test_config_values_are_type_and_range_checked(tmp_path, state, key, value, words):
    message = _config_error(tmp_path, state, json.dumps({**WAN_CONFIG, key: value}))
    assert words in message, message


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "1e999"])
def test_config_eps_nan_is_refused(tmp_path, state, literal):
    """Before: eps NaN was accepted (every norm's output NaN)."""
    text = json.dumps({**WAN_CONFIG, "eps": 12345}).replace("12345", literal)
    message = _config_error(tmp_path, state, text)
    assert "not valid JSON" in message and (literal in message or "out of range" in message), message


def test_diffusers_head_dim_product_is_bounded(tmp_path, state):
    cfg = {
        "_class_name": "WanTransformer3DModel",
        "num_attention_heads": 1 << 10,
        "attention_head_dim": 1 << 12,
    }
    message = _config_error(tmp_path, state, json.dumps(cfg))
    assert "num_attention_heads x attention_head_dim = 4194304 is over 65536" in message


# -- tensors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, value, words",
    [
        (torch.int64, 1, "int64"),
        (torch.bool, True, "bool"),
        (torch.float64, 1e300, "float64"),  # before: cast to inf silently
        (torch.float32, float("nan"), "NaN or Inf"),
    ],
)
def test_tensor_dtypes_are_checked_not_cast(tmp_path, state, dtype, value, words):
    bad = dict(state)
    name = "blocks.0.ffn.0.weight"
    bad[name] = torch.full_like(state[name], value, dtype=dtype)
    folder = _folder(tmp_path / "f", bad)
    with pytest.raises(PretrainedError) as err:
        VideoDiT.from_pretrained(folder)
    assert name in str(err.value) and words in str(err.value), str(err.value)


def test_values_beyond_a_half_precision_model_are_refused(tmp_path, state):
    big = dict(state)
    big["blocks.0.ffn.0.weight"] = state["blocks.0.ffn.0.weight"] * 0 + 1e6
    folder = _folder(tmp_path / "f", big)
    with pytest.raises(PretrainedError, match=r"beyond the model's dtype.*blocks\.0\.ffn\.0\.weight"):
        load_pretrained(VideoDiT(CFG).half(), folder)
    load_pretrained(VideoDiT(CFG), folder)  # float32 holds it


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_corrupt_safetensors_names_its_file(tmp_path, state, damage):
    folder = _folder(tmp_path / "f", state)
    path = folder / WEIGHTS
    raw = path.read_bytes()
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "garbage":
        raw = b"\xff" * 64
    else:
        raw = (10**12).to_bytes(8, "little") + raw[8:]  # a header claiming a terabyte
    path.write_bytes(raw)
    with pytest.raises(PretrainedError) as err:
        load_pretrained(VideoDiT(CFG), folder)
    assert str(path) in str(err.value) and "not a readable safetensors file" in str(err.value), str(err.value)


# -- fuzz ------------------------------------------------------------------------------------------

_VALUES = [
    None,
    0,
    1,
    2,
    -1,
    3,
    8,
    64,
    10**7,
    2**63,
    1.5,
    1e-6,
    float("inf"),
    True,
    False,
    "",
    "x",
    "t2v",
    [],
    [1, 2, 2],
    [1, 2],
    [-1, -1],
    {},
    {"a": [[[]]]},
    "rms_norm_across_heads",
]


def _mutate_config(rng: random.Random, config: dict) -> str:
    cfg = copy.deepcopy(config)
    for _ in range(rng.choice([1, 2, 3])):
        r = rng.random()
        key = rng.choice(sorted(cfg) + ["num_attention_heads", "attention_head_dim", "extra"])
        if r < 0.7:
            cfg[key] = copy.deepcopy(rng.choice(_VALUES))
        elif r < 0.8:
            cfg.pop(key, None)
        else:
            depth = rng.choice([3, 70])
            cfg[key] = json.loads("[" * depth + "]" * depth)
    text = json.dumps(cfg, allow_nan=True)
    r = rng.random()
    if r < 0.1:
        depth = rng.choice([63, 65, 100_000])
        text = text[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    elif r < 0.2:
        cut = rng.randrange(len(text))
        text = text[:cut]
    elif r < 0.25:
        text = text.replace("1e-06", rng.choice(["NaN", "-Infinity", "1e999", "1e-400"]))
    return text


@pytest.mark.timeout(120)
def test_fuzz_pretrained_configs_and_weight_maps(tmp_path, state):
    folder = _folder(tmp_path / "f", state, sharded=True)
    index = folder / f"{WEIGHTS}.index.json"
    base_index = json.loads(index.read_text())
    outcomes: dict[str, int] = {}
    t0 = time.perf_counter()
    for case in range(400):
        rng = random.Random(5 * 10**6 + case)
        (folder / "config.json").write_text(_mutate_config(rng, WAN_CONFIG))
        wm = copy.deepcopy(base_index)
        if rng.random() < 0.3:
            k = rng.choice(sorted(wm["weight_map"]))
            wm["weight_map"][k] = rng.choice(
                [
                    "../x.safetensors",
                    "/etc/passwd",
                    "a.safetensors",
                    "b.safetensors",
                    "",
                    5,
                    None,
                    "c.safetensors",
                    "sub/../a.safetensors",
                    "a.pth",
                    "\x00.safetensors",
                    "C:/w.safetensors",
                ]
            )
        if rng.random() < 0.05:
            wm = rng.choice([[], "x", {"weight_map": []}, {"weight_map": {}}])
        index.write_text(json.dumps(wm))
        try:
            cfg = config_from_folder(folder)
            assert cfg is not None
            if rng.random() < 0.25 and pre._parameters_at_least(cfg) < 10**7:
                load_pretrained(VideoDiT(cfg), folder)
            outcomes["loaded"] = outcomes.get("loaded", 0) + 1
        except PretrainedError as err:
            assert str(folder) in str(err), (case, str(err))
            outcomes["refused"] = outcomes.get("refused", 0) + 1
        except Exception as err:  # noqa: BLE001
            raise AssertionError(f"pretrained case {case}: {type(err).__name__}: {err}") from err
    assert time.perf_counter() - t0 < 60
    assert outcomes.get("refused", 0) > 100 and outcomes.get("loaded", 0) > 20, outcomes

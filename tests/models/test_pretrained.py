"""Wan 2.1 checkpoints into VideoDiT: diffusers' and Wan's layouts, strictness, and output equality with
diffusers' own ``WanTransformer3DModel`` (the proof that VideoDiT is Wan's architecture)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _tiny_models import tiny_wan_config

from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig
from lightning_adaptiveload.models.pretrained import (
    PretrainedError,
    config_from_folder,
    diffusers_to_wan_key,
    load_pretrained,
)

diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Tiny but complete: 2 blocks, 2 heads of width 12 (RoPE split 4/4/4), text, qk-norm, cross-attn norm.
_TINY = tiny_wan_config(ffn_dim=40, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=64)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    # Default inits leave norms at 1/0; random values make every parameter matter to the output.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


@pytest.fixture(scope="module")
def diffusers_folder(tmp_path_factory):
    torch.manual_seed(0)
    ref = diffusers.WanTransformer3DModel(**_TINY).float().eval()
    _randomise(ref, 1)
    folder = tmp_path_factory.mktemp("wan_diffusers")
    ref.save_pretrained(folder)
    return str(folder), ref


def _inputs(b=2, t=3, h=4, w=6, text_len=5, seed=2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, t, h, w, generator=gen)
    ctx = torch.randn(b, text_len, 16, generator=gen)
    timestep = torch.tensor([937.0, 41.5])[:b]
    return x, timestep, ctx


def test_key_mapping_examples():
    assert diffusers_to_wan_key("blocks.3.attn1.to_out.0.weight") == "blocks.3.self_attn.o.weight"
    assert diffusers_to_wan_key("blocks.0.attn2.norm_k.weight") == "blocks.0.cross_attn.norm_k.weight"
    assert diffusers_to_wan_key("blocks.1.norm2.bias") == "blocks.1.norm3.bias"
    assert diffusers_to_wan_key("blocks.1.ffn.net.0.proj.weight") == "blocks.1.ffn.0.weight"
    assert diffusers_to_wan_key("condition_embedder.time_proj.bias") == "time_projection.1.bias"
    assert diffusers_to_wan_key("scale_shift_table") == "head.modulation"
    assert diffusers_to_wan_key("blocks.7.scale_shift_table") == "blocks.7.modulation"
    assert diffusers_to_wan_key("blocks.0.attn2.add_k_proj.weight") is None
    assert diffusers_to_wan_key("proj_out.weight.extra") is None


def test_config_from_diffusers_folder(diffusers_folder):
    folder, _ = diffusers_folder
    cfg = config_from_folder(folder)
    assert (cfg.dim, cfg.num_heads, cfg.num_layers, cfg.ffn_dim) == (24, 2, 2, 40)
    assert (cfg.in_channels, cfg.out_channels, cfg.text_dim, cfg.freq_dim) == (4, 4, 16, 16)
    assert cfg.patch_size == (1, 2, 2) and cfg.qk_norm and cfg.cross_attn_norm


def test_diffusers_checkpoint_gives_diffusers_output_per_sample_timesteps(diffusers_folder):
    folder, ref = diffusers_folder
    ours = VideoDiT.from_pretrained(folder).eval()
    x, timestep, ctx = _inputs()
    with torch.no_grad():
        expected = ref(x, timestep, ctx, return_dict=False)[0]
        got = ours(x, timestep, ctx)
    assert got.shape == expected.shape == x.shape
    assert expected.abs().mean() > 0.1  # a non-trivial output
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_per_token_timesteps_match_diffusers(diffusers_folder):
    # Wan 2.2 (TI2V) passes one time per token, shape (B, S): ours must give diffusers' output for times that
    # differ between tokens, and the per-sample result when every token of a sample has its sample's time.
    folder, ref = diffusers_folder
    ours = VideoDiT.from_pretrained(folder).eval()
    x, timestep, ctx = _inputs()
    seq = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
    per_token = torch.rand(x.shape[0], seq, generator=torch.Generator().manual_seed(3)) * 1000.0
    with torch.no_grad():
        expected = ref(x, per_token, ctx, return_dict=False)[0]
        got = ours(x, per_token, ctx)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        equal = ours(x, timestep[:, None].expand(-1, seq).contiguous(), ctx)
        torch.testing.assert_close(equal, ours(x, timestep, ctx), rtol=1e-5, atol=1e-6)
    assert (got - ours(x, timestep, ctx)).abs().max() > 1e-3  # the per-token times matter
    with pytest.raises(ValueError, match="timestep must have shape"):
        ours(x, per_token[:, :-1], ctx)


def test_wan_layout_sharded_with_index(diffusers_folder, tmp_path):
    folder, ref = diffusers_folder
    source = VideoDiT.from_pretrained(folder)
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    keys = sorted(state)
    half = len(keys) // 2
    files = {
        "diffusion_pytorch_model-00001-of-00002.safetensors": keys[:half],
        "diffusion_pytorch_model-00002-of-00002.safetensors": keys[half:],
    }
    weight_map = {}
    for name, part in files.items():
        safetensors_torch.save_file({k: state[k] for k in part}, str(tmp_path / name))
        weight_map.update({k: name for k in part})
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    wan_config = {
        "_class_name": "WanModel",
        "model_type": "t2v",
        "dim": 24,
        "num_heads": 2,
        "num_layers": 2,
        "ffn_dim": 40,
        "in_dim": 4,
        "out_dim": 4,
        "text_dim": 16,
        "freq_dim": 16,
        "eps": 1e-6,
        "patch_size": [1, 2, 2],
        "text_len": 512,
        "window_size": [-1, -1],
        "qk_norm": True,
        "cross_attn_norm": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(wan_config))
    loaded = VideoDiT.from_pretrained(tmp_path)
    assert loaded.config == source.config
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)


def _write_diffusers_like(tmp_path, state):
    safetensors_torch.save_file(state, str(tmp_path / "diffusion_pytorch_model.safetensors"))


def test_strict_missing_unexpected_misshaped(diffusers_folder, tmp_path):
    folder, ref = diffusers_folder
    cfg = config_from_folder(folder)
    full = {k: v.contiguous() for k, v in ref.state_dict().items()}

    missing = dict(full)
    del missing["blocks.1.attn2.to_v.bias"]
    _write_diffusers_like(tmp_path, missing)
    with pytest.raises(PretrainedError, match=r"missing.*blocks\.1\.cross_attn\.v\.bias"):
        load_pretrained(VideoDiT(cfg), tmp_path)

    extra = dict(full, **{"blocks.0.attn1.to_gate.weight": torch.zeros(3)})
    _write_diffusers_like(tmp_path, extra)
    with pytest.raises(PretrainedError, match=r"blocks\.0\.attn1\.to_gate\.weight"):
        load_pretrained(VideoDiT(cfg), tmp_path)

    image = dict(full, **{"blocks.0.attn2.add_k_proj.weight": torch.zeros(24, 8)})
    _write_diffusers_like(tmp_path, image)
    with pytest.raises(PretrainedError, match="image-conditioning"):
        load_pretrained(VideoDiT(cfg), tmp_path)

    _write_diffusers_like(tmp_path, full)
    model = VideoDiT(VideoDiTConfig(**{**cfg.__dict__, "ffn_dim": 48}))
    with pytest.raises(
        PretrainedError,
        match=r"shape mismatch.*blocks\.0\.ffn\.0\.weight: checkpoint \(40, 24\) vs model \(48, 24\)",
    ):
        load_pretrained(model, tmp_path)

    with pytest.raises(PretrainedError, match="has no config.json"):
        VideoDiT.from_pretrained(tmp_path)
    assert VideoDiT.from_pretrained(tmp_path, config=cfg).config == cfg


def test_pickled_checkpoint_refused(tmp_path):
    torch.save({"a": torch.zeros(1)}, tmp_path / "model.pth")
    with pytest.raises(PretrainedError, match="pickled checkpoints are not loaded"):
        load_pretrained(VideoDiT(VideoDiTConfig.preset("tiny")), tmp_path)


def test_module_init_from(diffusers_folder):
    from lightning_adaptiveload.models.module import VideoDiTModule

    folder, ref = diffusers_folder
    module = VideoDiTModule(init_from=folder)
    assert module.model_config == config_from_folder(folder)
    module.configure_model()
    x, timestep, ctx = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(
            module.model.eval()(x, timestep, ctx),
            ref(x, timestep, ctx, return_dict=False)[0],
            rtol=1e-4,
            atol=1e-5,
        )
    assert os.path.isdir(module.hparams.init_from)
    # The folder's architecture is in the hyper-parameters: a checkpoint restores without the folder.
    again = VideoDiTModule(init_from=None, model_overrides=module.hparams.model_overrides)
    assert again.model_config == module.model_config
    with pytest.raises(FileNotFoundError, match="init_from='/no/such/folder' does not exist"):
        VideoDiTModule(init_from="/no/such/folder")

"""ingest: videos and images to latent shards (tiny random VAE and umT5, videos written by the test)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
import textwrap

import _paths
import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from lightning_adaptiveload.ingest import job as ing  # noqa: E402
from lightning_adaptiveload.ingest.settings import IngestSettings  # noqa: E402
from lightning_adaptiveload.loading.settings import Loader  # noqa: E402
from lightning_adaptiveload.planning.settings import Batching  # noqa: E402
from lightning_adaptiveload.shards.index import ShardIndex  # noqa: E402
from lightning_adaptiveload.shards.reader import iter_shard  # noqa: E402

Z = 4  # latent channels of the tiny VAE
ROOT = str(_paths.ROOT)


def _tiny_vae():
    # The library's demo VAE (one definition, ingest/demo.py) with 4 channels and non-trivial statistics.
    from lightning_adaptiveload.ingest.demo import tiny_random_vae

    return tiny_random_vae(
        z_dim=Z,
        temperal_downsample=[False, True, True],
        latents_mean=[0.3, -0.2, 0.1, 0.5],
        latents_std=[1.5, 0.7, 2.0, 1.1],
    )


def write_video(path, frames=20, fps=10, size=(48, 64), seed=0):
    """A small H.264/MPEG-4 clip of smooth random colours (height, width = size)."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.height, stream.width = size
        stream.pix_fmt = "yuv420p"
        base = rng.integers(0, 255, size=(size[0], size[1], 3)).astype(np.int16)
        for i in range(frames):
            img = np.clip(base + 8 * i, 0, 255).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vae")
    _tiny_vae().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
    """A tiny umT5 encoder and a word-level tokenizer built offline."""
    folder = tmp_path_factory.mktemp("umt5")
    vocab = {
        "<pad>": 0,
        "</s>": 1,
        "<unk>": 2,
        **{w: i + 3 for i, w in enumerate("a red cat dog runs on grass".split())},
    }
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", 1)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.UMT5Config(vocab_size=16, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    transformers.UMT5EncoderModel(cfg).eval().save_pretrained(folder)
    return str(folder)


# -- pure parts ------------------------------------------------------------------------------------


def test_wan_frame_count_and_sampling():
    assert [ing.wan_frame_count(n, 81) for n in (0, 1, 4, 5, 8, 9, 100)] == [0, 1, 1, 5, 5, 9, 81]
    assert ing.wan_frame_count(100, 20) == 17
    # 30 fps source at 15 fps: every second frame; 20 source frames hold 10 target frames -> 9 kept.
    assert ing.sample_frame_indices(20, 30.0, 15.0, 81) == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    # 25 -> 16 fps: round(i * 25 / 16).
    assert ing.sample_frame_indices(30, 25.0, 16.0, 5) == [0, 2, 3, 5, 6]
    # Target above the source rate: no duplicated frames.
    assert ing.sample_frame_indices(6, 10.0, 30.0, 81) == [0, 1, 2, 3, 4]
    assert ing.sample_frame_indices(6, 10.0, None, 81) == [0, 1, 2, 3, 4]


def test_bucket_choice_and_crop():
    buckets = ing.parse_buckets("480x832,832x480,624x624")
    assert ing.choose_bucket(1080, 1920, buckets) == (480, 832)
    assert ing.choose_bucket(1920, 1080, buckets) == (832, 480)
    assert ing.choose_bucket(1000, 1100, buckets) == (624, 624)
    plan = ing.size_plan(1080, 1920, buckets)
    # Cover 480x832 from 16:9: scale = max(480/1080, 832/1920) = 0.4444 -> 480 x 853, crop 10 columns off
    # each side.
    assert plan == {"resize": [480, 853], "crop": [0, 10, 480, 832]}
    assert ing.size_plan(100, 250, None) == {"resize": [100, 250], "crop": [2, 5, 96, 240]}
    with pytest.raises(ValueError, match="multiples of 16"):
        ing.parse_buckets("480x830")
    assert ing.parse_buckets("native") is None


def test_manifest_csv_and_jsonl(tmp_path):
    (tmp_path / "m.csv").write_text("path,caption,fps\na.mp4,a red cat,8\nsub/b.png,,\n")
    items = ing.read_manifest(tmp_path / "m.csv")
    assert [(os.path.relpath(i.path, tmp_path), i.caption, i.fps) for i in items] == [
        ("a.mp4", "a red cat", 8.0),
        (os.path.join("sub", "b.png"), "", None),
    ]
    (tmp_path / "m.jsonl").write_text('{"path": "a.mp4", "key": "k1"}\n{"caption": "x"}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: every row needs a 'path'"):
        ing.read_manifest(tmp_path / "m.jsonl")


# -- decode and encode -----------------------------------------------------------------------------


def test_decode_sampling_and_encode_equal_direct_diffusers(tmp_path):
    write_video(tmp_path / "clip.mp4", frames=20, fps=10, size=(48, 64))
    item = ing.IngestItem(str(tmp_path / "clip.mp4"), "clip")
    pixels, meta = ing.decode_input(item, 5.0, 81, [(32, 32), (32, 48)])
    # 10 -> 5 fps keeps every second frame: 10 frames available -> 9 (4k + 1).
    assert meta["frame_indices"] == [0, 2, 4, 6, 8, 10, 12, 14, 16]
    assert meta["frame_indices"] == ing.sample_frame_indices(20, 10.0, 5.0, 81)
    # A non-integer ratio (10 -> 4 fps: round(2.5 i)) streams the same indices as the pure function.
    _, meta4 = ing.decode_input(ing.IngestItem(item.path, "clip", fps=4.0), None, 81, None)
    assert meta4["frame_indices"] == ing.sample_frame_indices(20, 10.0, 4.0, 81) == [0, 2, 5, 8, 10]
    assert meta["fps"] == 5.0 and meta["source_fps"] == 10.0 and meta["source_size"] == [48, 64]
    assert meta["crop"] == [2, 0, 32, 48] and meta["resize"] == [36, 48]  # 4:3 -> the 32x48 bucket
    assert pixels.shape == (3, 9, 32, 48) and pixels.min() >= -1 and pixels.max() <= 1

    # The same frames through diffusers directly: decode every frame, pick, resize, crop, encode.
    with av.open(str(tmp_path / "clip.mp4")) as c:
        allf = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    frames = torch.from_numpy(np.stack([allf[i] for i in meta["frame_indices"]])).permute(0, 3, 1, 2).float()
    frames = torch.nn.functional.interpolate(frames, size=(36, 48), mode="bilinear", antialias=True).clamp(
        0, 255
    )
    direct_px = (frames[:, :, 2:34, :] / 127.5 - 1).permute(1, 0, 2, 3)[None]
    torch.testing.assert_close(pixels[None], direct_px)
    vae = _tiny_vae()
    with torch.no_grad():
        z = vae.encode(direct_px).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, Z, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, Z, 1, 1, 1)
    latent = ing.encode_video(vae, pixels[None])
    assert latent.shape == (1, Z, 3, 4, 6)  # 1 + (9 - 1) / 4 frames, /8 spatially
    torch.testing.assert_close(latent, (z - mean) / std, rtol=1e-5, atol=1e-5)


def test_image_is_one_frame(tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((40, 70, 3), np.uint8)).save(tmp_path / "im.png")
    pixels, meta = ing.decode_input(ing.IngestItem(str(tmp_path / "im.png"), "im"), 16.0, 81, None)
    assert pixels.shape == (3, 1, 32, 64) and meta["frame_indices"] == [0] and meta["fps"] is None
    assert meta["crop"] == [4, 3, 32, 64]


# -- the Lightning job ----------------------------------------------------------------------------


def _dataset(folder, n_videos=3, corrupt=True):
    folder.mkdir(exist_ok=True)
    for i in range(n_videos):
        write_video(folder / f"v{i}.mp4", frames=12 + 4 * i, fps=8, size=(32, 48), seed=i)
        (folder / f"v{i}.txt").write_text("a red cat runs")
    from PIL import Image

    Image.fromarray(np.full((32, 32, 3), 200, np.uint8)).save(folder / "img.png")
    if corrupt:
        (folder / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 this is not a video" * 10)
    return folder


def _all_keys(out):
    keys = []
    for name in sorted(os.listdir(out)):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(out, name)) as tf:
                keys += sorted({n.split(".")[0] for n in tf.getnames()})
    return keys


def test_ingest_writes_shards_text_and_reports_corrupt(tmp_path, vae_dir, text_dirs):
    src = _dataset(tmp_path / "in")
    out = tmp_path / "out"
    summary = ing.ingest(
        src,
        out,
        vae_dir,
        settings=IngestSettings(
            fps=8.0,
            max_frames=9,
            buckets="32x48,32x32",
            samples_per_shard=2,
            latent_dtype="float32",
            num_workers=0,
        ),
        text_encoder=text_dirs,
        progress=False,
        trainer_kwargs={"accelerator": "cpu", "devices": 1},
    )
    assert summary["written"] == 4 and summary["skipped"] == {"unreadable": 1}
    skipped = [json.loads(line) for line in open(out / "ingest-skipped-r000.jsonl")]
    assert [os.path.basename(s["path"]) for s in skipped] == ["broken.mp4"] and "broken.mp4" in skipped[0][
        "detail"
    ]
    index = ShardIndex.load(out / "index.json")
    assert index.num_samples == 4 and index.num_shards == 2
    # The writer's own index (.index-r000a000.json) is merged into index.json and removed.
    assert sorted(n for n in os.listdir(out) if n.endswith(".json")) == ["index.json"]
    samples = [s for i, sh in enumerate(index.shards) for s in iter_shard(sh, i)]
    by_src = {os.path.basename(s["meta"]["source"]): s for s in samples}
    assert by_src["img.png"]["latent"].shape == (Z, 1, 4, 4) and by_src["img.png"]["text"] is None
    v2 = by_src["v2.mp4"]  # 20 frames at 8 fps, max 9 -> 9 frames -> 3 latent frames
    assert v2["latent"].shape == (Z, 3, 4, 6) and v2["meta"]["frame_indices"] == list(range(9))
    # Text: the tiny umT5 on "a red cat runs" + </s>: 5 tokens of width 8, equal to a direct encode.
    tok = transformers.AutoTokenizer.from_pretrained(text_dirs)
    enc = transformers.UMT5EncoderModel.from_pretrained(text_dirs).eval()
    with torch.no_grad():
        direct = enc(**tok("a red cat runs", return_tensors="pt")).last_hidden_state[0]
    assert v2["text"].shape == (5, 8)
    torch.testing.assert_close(v2["text"], direct)
    # Rerun: nothing left to do, nothing written twice.
    again = ing.ingest(
        src,
        out,
        vae_dir,
        settings=IngestSettings(fps=8.0, max_frames=9, buckets="32x48,32x32", num_workers=0),
        progress=False,
        trainer_kwargs={"accelerator": "cpu", "devices": 1},
    )
    assert again["written"] == 0 and again["already_done"] == 4
    keys = _all_keys(out)
    assert len(keys) == len(set(keys)) == 4
    assert sorted(n for n in os.listdir(out) if n.endswith(".json")) == ["index.json"]


def test_ingest_on_error_raise_names_the_file(tmp_path, vae_dir):
    src = tmp_path / "in"
    src.mkdir()
    (src / "broken.mp4").write_bytes(b"garbage" * 50)
    with pytest.raises(RuntimeError, match=r"broken\.mp4"):
        ing.ingest(
            src,
            tmp_path / "out",
            vae_dir,
            settings=IngestSettings(on_error="raise", num_workers=0),
            progress=False,
            trainer_kwargs={"accelerator": "cpu", "devices": 1},
        )


def test_cli_ingest(tmp_path, vae_dir, capsys):
    from PIL import Image

    from lightning_adaptiveload.cli import main as cli

    src = tmp_path / "in"
    src.mkdir()
    Image.fromarray(np.full((32, 48, 3), 90, np.uint8)).save(src / "a.png")
    (src / "broken.mp4").write_bytes(b"garbage" * 50)
    out = tmp_path / "out"
    code = cli.main(
        [
            "ingest",
            str(src),
            "--out",
            str(out),
            "--vae",
            vae_dir,
            "--buckets",
            "native",
            "--accelerator",
            "cpu",
            "--devices",
            "1",
            "--num-workers",
            "0",
            "--no-progress",
        ]
    )
    assert code == 1  # one input skipped
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["written"] == 1 and report["skipped"] == {"unreadable": 1}
    assert ShardIndex.load(out / "index.json").shards[0].latent_shapes == [(Z, 1, 4, 6)]


_RUNNER = textwrap.dedent("""
    import os, sys, json
    import torch
    torch.set_num_threads(1)
    from lightning.pytorch import Callback
    from lightning_adaptiveload.ingest import job as ing
    from lightning_adaptiveload.ingest.settings import IngestSettings
    cfg = json.loads(sys.argv[1])

    class Kill(Callback):
        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            if cfg.get("kill_after") is not None and batch_idx + 1 >= cfg["kill_after"]:
                os._exit(17)  # a hard kill: no close, no index

    kw = {"accelerator": "cpu", "devices": cfg["world"], "strategy": "ddp" if cfg["world"] > 1 else "auto"}
    settings = IngestSettings(fps=8.0, max_frames=5, buckets="32x48,32x32", samples_per_shard=cfg["per_shard"],
                              num_workers=0)
    s = ing.ingest(cfg["src"], cfg["out"], cfg["vae"], settings=settings, progress=False, trainer_kwargs=kw,
                   callbacks=[Kill()])
    with open(os.path.join(cfg["out"], f"summary-{os.environ.get('LOCAL_RANK', '0')}.json"), "w") as f:
        json.dump(s, f)
""")


def _launch(cfg, world, timeout=120):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    procs = []
    if world > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0")
    for r in range(world):
        e = {**env, "LOCAL_RANK": str(r)} if world > 1 else env
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RUNNER, json.dumps(cfg)],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append((p.wait(timeout=timeout), p.stdout.read()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return outs


@pytest.mark.timeout(200)
def test_two_process_ingest_killed_then_resumed_writes_every_input_once(tmp_path, vae_dir):
    src = _dataset(tmp_path / "in", n_videos=5, corrupt=False)
    out = tmp_path / "out"
    inputs = {it.key for it in ing.find_inputs(src)}
    # Two ranks of 3 inputs each, hard-killed (os._exit) after their 3rd sample: with 2 samples per shard
    # each leaves one complete shard and a temp file holding its 3rd sample, and no index.
    results = _launch(
        {"src": str(src), "out": str(out), "vae": vae_dir, "world": 2, "kill_after": 3, "per_shard": 2}, 2
    )
    assert [code for code, _ in results] == [17, 17], results
    first = _all_keys(out)
    assert len(first) == len(set(first)) == 4 and not (out / "index.json").exists()
    assert {n[:4] for n in os.listdir(out) if n.endswith(".tar")} == {"r000", "r001"}  # both ranks wrote
    assert len([n for n in os.listdir(out) if n.endswith(".tmp")]) == 2
    # Resume on two ranks, to the end (rank 0 writes the index after both finish).
    results = _launch({"src": str(src), "out": str(out), "vae": vae_dir, "world": 2, "per_shard": 2}, 2)
    assert [code for code, _ in results] == [0, 0], results
    summaries = [json.load(open(out / f"summary-{r}.json")) for r in range(2)]
    assert [s["already_done"] for s in summaries] == [4, 4]
    assert sum(s["written"] for s in summaries) == len(inputs) - 4
    keys = _all_keys(out)
    assert len(keys) == len(set(keys)) and set(keys) == inputs
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert ShardIndex.load(out / "index.json").num_samples == len(inputs)
    assert not [n for n in os.listdir(out) if n.startswith(".index-")]  # every rank's own index, merged
    # A rerun on one rank (another world size) finds everything done.
    again = ing.ingest(
        src,
        out,
        vae_dir,
        settings=IngestSettings(fps=8.0, max_frames=5, buckets="32x48,32x32", num_workers=0),
        progress=False,
        trainer_kwargs={"accelerator": "cpu", "devices": 1},
    )
    assert again["written"] == 0 and again["already_done"] == len(inputs)


def test_ingested_shards_train_with_quickstart_settings(tmp_path, vae_dir):
    """A short fit of the tiny model on ingested shards, with the quickstart's data settings."""
    import lightning.pytorch as pl

    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.models.module import OptimizerSettings, SamplingSettings, VideoDiTModule

    src = _dataset(tmp_path / "in", n_videos=3, corrupt=False)
    out = tmp_path / "train"
    ing.ingest(
        src,
        out,
        vae_dir,
        settings=IngestSettings(fps=8.0, max_frames=9, buckets="32x48,32x32", num_workers=0),
        progress=False,
        trainer_kwargs={"accelerator": "cpu", "devices": 1},
    )
    data = AdaptiveLoadDataModule(
        train_shards=str(out),
        batching=Batching(max_tokens=1024, max_compute="auto", sizing="dual"),
        loader=Loader(num_workers=0, seed=0),
    )
    model = VideoDiTModule(
        preset="tiny",
        model_overrides={"in_channels": Z, "out_channels": Z},
        optimizer=OptimizerSettings(lr=2e-3),
        sampling=SamplingSettings(shift=1.0),
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        reload_dataloaders_every_n_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    assert trainer.global_step >= 1
    assert torch.isfinite(trainer.callback_metrics["train/loss"])


# -- the demo path: no downloaded weights (issue 38, item 4) -------------------------------------------------


def _demo_cli(src, out, *extra):
    from lightning_adaptiveload.cli import main as cli

    args = ["ingest", str(src), "--out", str(out), "--vae", "tiny-random", "--buckets", "32x48,48x32,32x32"]
    args += [
        "--max-frames",
        "5",
        "--accelerator",
        "cpu",
        "--devices",
        "1",
        "--num-workers",
        "0",
        "--no-progress",
    ]
    return cli.main([*args, *extra])


def test_demo_ingest_runs_without_weights_and_marks_its_shards(tmp_path, capsys, caplog):
    src, out = tmp_path / "videos", tmp_path / "train"
    code = _demo_cli(src, out, "--demo-clips", "2", "--text-encoder", "tiny-random")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["written"] == 3 and report["demo"] is True  # two generated clips and one image
    assert "NOT for training" in captured.err and "--data.init_args.train_shards=" in captured.err
    assert "NOT FOR TRAINING" in caplog.text  # the loud warning at the start
    assert sorted(p.name for p in src.iterdir()) == [
        "demo-00.mp4", "demo-00.txt", "demo-01.mp4", "demo-01.txt", "demo-image.png", "demo-image.txt",
    ]  # fmt: skip
    index = ShardIndex.load(out / "index.json")
    assert (
        index.metadata["demo"]["vae"] == "tiny-random"
        and "NOT FOR TRAINING" in index.metadata["demo"]["note"]
    )
    samples = [s for i, sh in enumerate(index.shards) for s in iter_shard(sh, i)]
    assert all(s["meta"]["demo"] is True for s in samples)
    # Wan's 16 latent channels; text states of the tiny model preset's width (32), one per character + </s>.
    assert {s["latent"].shape[0] for s in samples} == {16}
    clip = next(s for s in samples if s["meta"]["source"].endswith("demo-00.mp4"))
    caption = (src / "demo-00.txt").read_text().strip()
    assert clip["text"].shape == (len(caption) + 1, 32) and clip["meta"]["caption"] == caption


def test_demo_and_real_shards_never_share_a_folder(tmp_path, vae_dir, capsys):
    from lightning_adaptiveload.ingest.demo import write_demo_clips

    src = tmp_path / "videos"
    write_demo_clips(src, count=1, image=False)
    kw = dict(
        settings=IngestSettings(fps=8.0, max_frames=5, buckets="32x48,48x32,32x32", num_workers=0),
        progress=False,
    )
    kw["trainer_kwargs"] = {"accelerator": "cpu", "devices": 1}
    ing.ingest(src, tmp_path / "demo", "tiny-random", **kw)
    with pytest.raises(FileExistsError, match="holds DEMO shards"):
        ing.ingest(src, tmp_path / "demo", vae_dir, **kw)
    ing.ingest(src, tmp_path / "real", vae_dir, **kw)
    with pytest.raises(FileExistsError, match="encoded with a real VAE"):
        ing.ingest(src, tmp_path / "real", "tiny-random", **kw)
    assert "demo" not in ShardIndex.load(tmp_path / "real" / "index.json").metadata


def test_demo_ingest_without_inputs_says_what_to_pass(tmp_path, capsys):
    assert _demo_cli(tmp_path / "nothing", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "--demo-clips" in err and len(err.splitlines()) == 1


def test_training_on_demo_shards_warns(tmp_path):
    import lightning.pytorch as pl

    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    from lightning_adaptiveload.models.module import VideoDiTModule

    src = _dataset(tmp_path / "in", n_videos=2, corrupt=False)
    out = tmp_path / "train"
    ing.ingest(src, out, "tiny-random", settings=IngestSettings(fps=8.0, max_frames=5, buckets="32x48,32x32", num_workers=0), progress=False, trainer_kwargs={"accelerator": "cpu", "devices": 1})  # fmt: skip
    data = AdaptiveLoadDataModule(
        train_shards=str(out),
        batching=Batching(max_tokens=1024),
        loader=Loader(num_workers=0),
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, reload_dataloaders_every_n_epochs=1,
    )  # fmt: skip
    with pytest.warns(UserWarning, match="DEMO DATA, NOT FOR TRAINING"):
        trainer.fit(VideoDiTModule(preset="tiny"), data)


@pytest.mark.timeout(240)
def test_hostile_inputs_are_counted_skips_recorded_for_resume(tmp_path, vae_dir, monkeypatch):
    """Issue 42: each of these files used to end the run (or exhaust memory), even with on_error='skip'.

    Now each is a counted skip, recorded in the skip log and index.json's metadata; a rerun does not try
    them again, and a FIFO named like a shard in the output folder does not hang it.
    """
    from _hostile_media import gif_bomb, png_header_only
    from _hostile_media import write_video as write_odd_video
    from PIL import Image

    src = tmp_path / "in"
    src.mkdir()
    Image.fromarray(np.full((32, 48, 3), 90, np.uint8)).save(src / "good.png")
    (src / "bomb.gif").write_bytes(gif_bomb(4000, 4000, 81))
    (src / "bomb.png").write_bytes(png_header_only(60000, 60000))
    write_odd_video(src / "tiny.mp4", (1, 1))
    Image.fromarray(np.full((32, 48, 3), 90, np.uint8)).save(src / "latin1.png")
    (src / "latin1.txt").write_bytes("un caf\xe9".encode("latin-1"))
    out = tmp_path / "out"
    kw = dict(
        settings=IngestSettings(fps=None, buckets="native", num_workers=0),
        progress=False,
        trainer_kwargs={"accelerator": "cpu", "devices": 1},
    )
    summary = ing.ingest(src, out, vae_dir, **kw)
    assert summary["written"] == 1
    assert summary["skipped"] == {"too_large": 2, "too_small": 1, "bad_caption": 1}, summary
    records = [json.loads(line) for line in open(out / "ingest-skipped-r000.jsonl")]
    assert sorted(os.path.basename(r["path"]) for r in records) == [
        "bomb.gif",
        "bomb.png",
        "latin1.png",
        "tiny.mp4",
    ]
    assert all(os.path.basename(r["path"]).split(".")[0] in r["detail"] for r in records)
    index = ShardIndex.load(out / "index.json")
    assert index.num_samples == 1
    assert index.metadata["ingest_skipped"] == {"bad_caption": 1, "too_large": 2, "too_small": 1}
    # A FIFO named like a complete shard: ignored (a read would block for ever).
    os.mkfifo(out / "r000a009-000000.tar")
    tried = []
    real = ing.decode_input
    monkeypatch.setattr(ing, "decode_input", lambda *a, **k: tried.append(a[0].path) or real(*a, **k))
    again = ing.ingest(src, out, vae_dir, **kw)
    assert again["written"] == 0 and again["skipped"] == {} and tried == []
    assert again["already_done"] == 1 and again["already_skipped"] == 4 and again["assigned"] == 0
    # Deleting the skip log retries them.
    os.remove(out / "ingest-skipped-r000.jsonl")
    third = ing.ingest(src, out, vae_dir, **kw)
    assert third["assigned"] == 4 and sum(third["skipped"].values()) == 4


def test_ingest_of_a_folder_without_inputs_says_so(tmp_path, capsys):
    # It used to exit 0 with "written": 0 and no index.json, then suggest a training command that failed.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a video")
    with pytest.raises(ValueError, match=r"no videos or images found under .*empty"):
        ing.ingest(empty, tmp_path / "out", "tiny-random", progress=False)


def test_ingest_where_every_input_fails_reports_it_and_writes_no_index(tmp_path, capsys):
    # It used to crash at the end ("FileNotFoundError: no shard paths in []") without its summary.
    src = tmp_path / "bad"
    src.mkdir()
    (src / "bad.mp4").write_bytes(b"not an mp4 at all")
    out = tmp_path / "out"
    assert _demo_cli(src, out) == 1
    captured = capsys.readouterr()
    assert '"written": 0' in captured.out
    assert "no sample was written" in captured.err and "1 of 1 inputs were skipped" in captured.err
    assert "DEMO shards" not in captured.err  # no training command for a folder without shards
    assert not (out / "index.json").exists()
    assert list(out.glob("ingest-skipped-r*.jsonl"))

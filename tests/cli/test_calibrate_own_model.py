"""``calibrate --recipe`` measures the recipe's own ``model.class_path`` (issue 59, item 4): the example's
diffusers Wan, a counting module whose ``training_step`` sees every timed batch, refusals that name the class
and why before anything is measured, and the quickstart's ``VideoDiTModule`` as before."""

from __future__ import annotations

import sys
import textwrap
import uuid

import pytest
import torch
import yaml
from _paths import ROOT
from _timing import scaled

from lightning_adaptiveload.cli.calibrate import main as calibrate_main

# Few shapes, one timed run, the budget given (no memory search) unless a test searches it.
FAST = ["--device", "cpu", "--num-shapes", "2", "--warmup", "0", "--repeats", "1", "--no-progress"]

# The modules a test recipe names, written beside the recipe (imported from the recipe's folder, as
# `python -m` from that folder would find them).
MODULES = textwrap.dedent(
    '''
    import time

    import torch
    import lightning.pytorch as pl


    class CountingModule(pl.LightningModule):
        """Reads the batch dict of docs/data_path.md and records every training_step call."""

        calls = []

        def __init__(self, width: int = 8, in_channels: int = 16, text_dim: int = 16):
            super().__init__()
            self.save_hyperparameters()
            self.proj = torch.nn.Linear(in_channels, width)
            self.text = torch.nn.Linear(text_dim, width)
            self.out = torch.nn.Linear(width, in_channels)

        def _error(self, latents, text):
            x = latents.float().flatten(2).transpose(1, 2)  # (B, T*H*W, C)
            h = self.proj(x)
            if text is not None:
                h = h + self.text(text.float()).mean(1, keepdim=True)
            return (self.out(torch.relu(h)) - x).square().sum()

        def training_step(self, batch, batch_idx):
            packed = bool(batch.get("packed"))
            shapes = [tuple(x.shape) for x in batch["latents"]] if packed else [tuple(batch["latents"].shape)]
            type(self).calls.append({"packed": packed, "shapes": shapes, "keys": sorted(batch),
                                     "batch_size": batch["batch_size"], "num_tokens": batch["num_tokens"],
                                     "text": None if batch["text"] is None else tuple(batch["text"].shape)})
            if packed:
                err = sum(self._error(x[None], None if batch["text"] is None else batch["text"][i : i + 1])
                          for i, x in enumerate(batch["latents"]))
            else:
                err = self._error(batch["latents"], batch["text"])
            # On a busy CPU a step this small is all overhead and scheduling noise: make its time grow with its
            # tokens well above that, so that the fit always has a length dependence to find.
            time.sleep(2e-4 * batch["num_tokens"])
            self.log("train/loss", err, prog_bar=True)
            return err * self.trainer.world_size / max(batch["global_tokens"], 1)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)


    class PackingModule(CountingModule):
        calls = []
        runs_packed_batches = True


    class NoStepModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)


    class BrokenStepModule(CountingModule):
        calls = []

        def training_step(self, batch, batch_idx):
            type(self).calls.append(batch_idx)
            return self.proj(batch["image"]).sum()  # not the DataModule's batch contract


    class NoLossModule(CountingModule):
        calls = []

        def training_step(self, batch, batch_idx):
            type(self).calls.append(batch_idx)
            return None


    class ManualModule(CountingModule):
        calls = []

        def __init__(self):
            super().__init__()
            self.automatic_optimization = False


    class CudaModule(CountingModule):
        calls = []

        def training_step(self, batch, batch_idx):
            type(self).calls.append(batch_idx)
            return super().training_step(batch, batch_idx) + torch.zeros((), device="cuda").cpu()
    '''
)


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matmuls gain nothing from a second thread; on a busy machine the spinning threads cost a lot.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def own_recipe(tmp_path, monkeypatch):
    """``make(class_name, init_args=None, data=None) -> (recipe path, module)``: a recipe naming a class of
    :data:`MODULES`, written beside it under a fresh module name; ``sys.path`` and the module are dropped after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"calib_models_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODULES)

    def make(class_name, init_args=None, data=None, trainer=None):
        recipe = {
            "trainer": {"precision": "32-true", **(trainer or {})},
            "model": {"class_path": f"{name}.{class_name}", "init_args": init_args or {}},
            "data": {
                "class_path": "lightning_adaptiveload.AdaptiveLoadDataModule",
                "init_args": data
                or {
                    "train_shards": str(tmp_path / "data"),
                    "loader": {"text_pad_to": 12},
                    "synthetic": {"mix": "tiny", "text_len_range": [1, 12], "text_dim": 16},
                },
            },
        }
        path = tmp_path / f"{class_name}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path, name

    yield make
    monkeypatch.delitem(sys.modules, name, raising=False)


def _classes(name):
    return sys.modules[name]


@pytest.mark.timeout(scaled(300))
def test_the_wan_example_recipe_measures_its_own_model(tmp_path, monkeypatch):
    # Before: the header read `model: wan-1.3b {"num_layers": 1}`, our preset, and the recipe's model went unused.
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "wan_flow", raising=False)
    from lightning_adaptiveload.tools.calibrate_bench import ModuleBench

    steps = []  # every step the bench ran: which module's training_step, on which network, which contract
    loss = ModuleBench.loss

    def recorded(self, batch):
        steps.append(
            (
                type(self.module).__qualname__,
                type(self.module.transformer).__name__,
                bool(batch.get("packed")),
            )
        )
        return loss(self, batch)

    monkeypatch.setattr(ModuleBench, "loss", recorded)
    out, results = tmp_path / "cal.yaml", tmp_path / "results.yaml"
    recipe = ROOT / "examples" / "your_own_model" / "wan_flow.yaml"
    rc = calibrate_main(
        ["--recipe", str(recipe), *FAST, "--max-tokens", "225", "--out", str(out), "--results", str(results)]
    )  # fmt: skip
    assert rc == 0
    text = out.read_text()
    header = [line for line in text.splitlines() if line.startswith("# model:")]
    assert header and header[0].startswith("# model: wan_flow.WanFlowModule ")
    assert '"num_layers": 2' in header[0] and '"text_dim": 16' in header[0]
    assert "wan-1.3b" not in text and "VideoDiT" not in text
    assert "# step: WanFlowModule.training_step + backward" in text
    assert "from the recipe's folder" in text  # wan_flow.py sits beside the recipe
    assert "text 12 x 16" in text and "from mix tiny" in text  # the recipe's text and mix
    assert "packs timed through its training_step (runs_packed_batches = True)" in text
    # Every step was the example's training_step on the diffusers Wan it builds: bucketed batches and packs.
    assert {s[:2] for s in steps} == {("WanFlowModule", "WanTransformer3DModel")}
    assert {s[2] for s in steps} == {True, False}
    saved = yaml.safe_load(results.read_text())
    assert saved["model"]["class_path"] == "wan_flow.WanFlowModule"
    assert saved["model"]["init_args"] == {"num_layers": 2, "text_dim": 16, "lr": 1.0e-3}
    assert saved["model"]["parameters"] > 0
    assert saved["timings"] and all(t["seconds"] > 0 for t in saved["timings"])
    assert {t["seq_len"] for t in saved["timings"]} == {24, 225}
    assert any(p["path"] == "packed" and p["samples"] > 1 for p in saved["points"])


@pytest.mark.timeout(scaled(240))
def test_every_timing_comes_from_the_modules_own_training_step(own_recipe, tmp_path):
    recipe, name = own_recipe("CountingModule", {"width": 6})
    results = tmp_path / "results.yaml"
    rc = calibrate_main(
        ["--recipe", str(recipe), *FAST, "--repeats", "2", "--warmup", "1", "--memory-budget-gb", "0.002",
         "--max-batch", "4", "--out", str(tmp_path / "cal.yaml"), "--results", str(results)]
    )  # fmt: skip
    assert rc == 0
    calls = _classes(name).CountingModule.calls
    saved = yaml.safe_load(results.read_text())
    assert saved["model"]["class_path"] == f"{name}.CountingModule" and saved["model"]["init_args"] == {
        "width": 6
    }
    assert f"# model: {name}.CountingModule" in (tmp_path / "cal.yaml").read_text()
    # The bucketed contract of loading/collate.py, with the recipe's text padded to text_pad_to.
    assert all(not c["packed"] for c in calls), "the module does not take packs: none was given"
    contract = {"latents", "text", "text_mask", "keys", "meta", "seq_len", "batch_size", "num_tokens", "cost",
                "global_tokens"}  # fmt: skip
    assert all(set(c["keys"]) == contract for c in calls)
    assert f"{name} from the recipe's folder" in (tmp_path / "cal.yaml").read_text()  # written beside it
    assert all(c["text"] == (c["batch_size"], 12, 16) for c in calls)
    # Every timed point ran through training_step: warm-up + repeats calls of its shape and batch size.
    for t in saved["timings"]:
        shape = tuple(int(d) for d in t["shape"].split("x"))
        seen = [c for c in calls if c["shapes"] == [(t["batch_size"], *shape)]]
        assert len(seen) >= 1 + 2, (t, len(seen))
    assert saved["probes"] and all(
        p["peak_bytes"] > 0 for p in saved["probes"]
    )  # the memory search ran it too
    assert "not timed: CountingModule does not set runs_packed_batches" in (tmp_path / "cal.yaml").read_text()


@pytest.mark.timeout(scaled(240))
def test_a_module_that_takes_packs_is_timed_on_packs(own_recipe, tmp_path):
    recipe, name = own_recipe("PackingModule")
    rc = calibrate_main(
        ["--recipe", str(recipe), *FAST, "--max-tokens", "450", "--out", str(tmp_path / "c.yaml")]
    )
    assert rc == 0
    calls = _classes(name).PackingModule.calls
    packs = [c for c in calls if c["packed"]]
    assert packs and all(len(c["shapes"]) == c["batch_size"] for c in packs)
    assert {"cu_seqlens", "seq_lens", "latent_shapes", "text_lens"} <= set(packs[0]["keys"])
    assert "packs timed through its training_step" in (tmp_path / "c.yaml").read_text()


@pytest.mark.parametrize(
    "class_name, args, words, steps",
    [
        ("NoStepModule", [], "defines no training_step", 0),
        (
            "BrokenStepModule",
            [],
            "training_step failed on a probe batch (one sample of latent shape [16, 1, 8, 12]"
            ", on cpu): KeyError: 'image'",
            1,
        ),  # fmt: skip
        ("NoLossModule", [], "its training_step returned None, not a scalar loss", 1),
        ("ManualModule", [], "manual optimization", 0),
        ("CountingModule", ["--packs"], "cannot time packs", 0),
        ("CountingModule", ["--preset", "tiny"], "--preset: this sets VideoDiTModule's model", 0),
        ("CountingModule", ["--compile"], "--compile: this sets VideoDiTModule's model", 0),
    ],
)
def test_a_module_that_cannot_be_measured_is_refused_before_measuring(
    own_recipe, capsys, class_name, args, words, steps
):
    recipe, name = own_recipe(class_name)
    assert calibrate_main(["--recipe", str(recipe), *FAST, "--max-tokens", "450", *args]) == 2
    err = capsys.readouterr().err
    assert words in err, err
    assert f"{name}.{class_name}" in err, err  # the message names the class
    module = sys.modules.get(name)
    calls = getattr(getattr(module, class_name, None), "calls", [])
    assert len(calls) == steps  # nothing was timed: at most the one probe step


def test_the_packed_schedule_refuses_a_module_without_packs(own_recipe, capsys):
    data = {"plan": {"schedule": "packed"}, "synthetic": {"mix": "tiny", "text_dim": 16}}
    recipe, name = own_recipe("CountingModule", data=data)
    assert calibrate_main(["--recipe", str(recipe), *FAST, "--max-tokens", "450"]) == 2
    err = capsys.readouterr().err
    assert f"cannot measure {name}.CountingModule" in err and "runs_packed_batches = True" in err, err
    assert _classes(name).CountingModule.calls == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the module runs on this GPU")
def test_a_module_that_needs_a_gpu_is_refused_on_the_cpu(own_recipe, capsys):
    recipe, name = own_recipe("CudaModule")
    assert calibrate_main(["--recipe", str(recipe), *FAST, "--max-tokens", "450"]) == 2
    err = capsys.readouterr().err
    assert f"cannot measure {name}.CudaModule" in err and "it seems to need a GPU" in err, err


@pytest.mark.parametrize(
    "class_path, init_args, words",
    [
        (
            "subprocess.Popen",
            {"args": ["touch", "MARKER"]},
            "does not correspond to a subclass of LightningModule",
        ),
        ("os.system", {"command": "touch MARKER"}, "does not correspond to a subclass of LightningModule"),
        ("no_such_package_59.Model", {}, "No module named 'no_such_package_59'"),
        (
            "lightning_adaptiveload.LoadBalanceMonitor",
            {},
            "does not correspond to a subclass of LightningModule",
        ),
    ],
)
def test_a_class_path_that_is_not_a_lightning_module_is_never_called(
    tmp_path, capsys, class_path, init_args, words
):
    marker = tmp_path / "MARKER"
    args = {k: (str(marker) if v == "MARKER" else [str(marker) if x == "MARKER" else x for x in v]
                if isinstance(v, list) else v.replace("MARKER", str(marker))) for k, v in init_args.items()}  # fmt: skip
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"class_path": class_path, "init_args": args},
                                      "data": {"init_args": {"synthetic": {"mix": "tiny"}}}}))  # fmt: skip
    assert calibrate_main(["--recipe", str(recipe), *FAST]) == 2
    err = capsys.readouterr().err
    assert f"--recipe {recipe}: model.class_path {class_path} cannot be built" in err and words in err, err
    assert not marker.exists()


def test_an_unknown_init_arg_is_named(own_recipe, capsys):
    recipe, _ = own_recipe("CountingModule", {"widht": 4})
    assert calibrate_main(["--recipe", str(recipe), *FAST]) == 2
    assert "Option 'widht' is not accepted" in capsys.readouterr().err


@pytest.mark.timeout(scaled(240))
def test_the_quickstart_still_measures_video_dit_from_its_preset(tmp_path, monkeypatch):
    from lightning_adaptiveload.cli import calibrate as cli_calibrate

    seen = []

    def preset_calibrate(preset, model_overrides, settings, **kwargs):
        seen.append(preset)  # the preset path, with a synthetic timer: the model builds and runs its probes
        timer = lambda shapes: 1e-3 + 1e-6 * sum(t * h * w for _, t, h, w in shapes)  # noqa: E731
        return real(preset, model_overrides, settings, timer=timer, **kwargs)

    real = cli_calibrate.calibrate
    monkeypatch.setattr(cli_calibrate, "calibrate", preset_calibrate)
    out, results = tmp_path / "cal.yaml", tmp_path / "results.yaml"
    rc = calibrate_main(
        ["--recipe", "quickstart", *FAST, "--max-tokens", "450", "--out", str(out), "--results", str(results)]
    )  # fmt: skip
    assert rc == 0 and seen == ["tiny"]
    header = next(line for line in out.read_text().splitlines() if line.startswith("# model:"))
    assert header.startswith("# model: tiny {} (lightning_adaptiveload.VideoDiTModule, ")
    model = yaml.safe_load(results.read_text())["model"]
    assert model["class_path"] == "lightning_adaptiveload.VideoDiTModule"
    assert model["init_args"] == {"preset": "tiny", "model_overrides": {}}


@pytest.mark.timeout(scaled(240))
def test_without_a_synthetic_block_the_batches_follow_the_training_shards(
    own_recipe, synthetic_shards, tmp_path
):
    shards = synthetic_shards([6, 6], seed=3, text_len_range=(2, 7), text_dim=16, dtype="float32")
    recipe, name = own_recipe("CountingModule", data={"train_shards": shards})
    results = tmp_path / "results.yaml"
    rc = calibrate_main(
        ["--recipe", str(recipe), *FAST, "--max-tokens", "450", "--no-packs", "--out", str(tmp_path / "c.yaml"),
         "--results", str(results)]
    )  # fmt: skip
    assert rc == 0
    calls = _classes(name).CountingModule.calls
    # The shards' text: width 16, their longest caption (7 states); their latents' dtype.
    assert calls and all(c["text"] == (c["batch_size"], 7, 16) for c in calls)
    assert "latents float32, text 7 x 16" in (tmp_path / "c.yaml").read_text()
    from lightning_adaptiveload.shards.index import ShardIndex

    index = ShardIndex.load(f"{shards}/index.json")
    in_shards = {tuple(s) for sh in index.shards for s in sh.latent_shapes}
    timed = {
        tuple(int(d) for d in t["shape"].split("x")) for t in yaml.safe_load(results.read_text())["timings"]
    }
    assert timed <= in_shards and len(timed) == 2  # the shortest and the longest of the shards' shapes


def test_a_recipe_without_data_to_shape_the_batches_is_refused(own_recipe, capsys, tmp_path):
    recipe, _ = own_recipe("CountingModule", data={"train_shards": str(tmp_path / "missing")})
    assert calibrate_main(["--recipe", str(recipe), *FAST, "--max-tokens", "450"]) == 2
    err = capsys.readouterr().err
    assert "data.init_args.train_shards" in err and "cannot be read" in err and "--mix" in err, err
    # Shapes from a flag, but nothing says how wide the text is.
    assert calibrate_main(["--recipe", str(recipe), *FAST, "--max-tokens", "450", "--mix", "tiny"]) == 2
    assert "give --text-dim" in capsys.readouterr().err

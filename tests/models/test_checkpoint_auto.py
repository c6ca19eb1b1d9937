"""Per-batch choice of the checkpointed blocks (issue 17): the memory model, its fit, the model's "auto" mode."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch._dynamo
from _paths import ROOT
from test_acceleration import _CFG, _grads, _inputs, _model

from lightning_adaptiveload.models.acceleration import (
    MAX_GRAPHS_PER_MODE,
    compile_blocks,
    probe_activation_memory,
)
from lightning_adaptiveload.models.memory import ActivationMemory, MemoryPoint, blocks_to_checkpoint

GIB = 2**30
_TRUE = ActivationMemory(num_blocks=30, base_bytes=20 * GIB, token_all=1e5, text_all=2e5, token_block=8e4,
                         text_block=3e5)  # fmt: skip


def _probe_points(model: ActivationMemory, batches, counts=(30, 15)) -> list[MemoryPoint]:
    return [MemoryPoint(b, s, t, k, model.peak_bytes(b, s, t, k)) for b, s, t in batches for k in counts]


def test_blocks_to_checkpoint_is_the_fewest_that_fit():
    assert blocks_to_checkpoint(30, 60.0, 2.0) == 0
    assert blocks_to_checkpoint(30, 30.0, 2.0) == 15
    assert blocks_to_checkpoint(30, 31.9, 2.0) == 15
    assert blocks_to_checkpoint(30, 0.0, 2.0) == 30
    assert blocks_to_checkpoint(30, 5.0, 0.0) == 0
    with pytest.raises(ValueError, match="over the memory budget"):
        blocks_to_checkpoint(30, -1.0, 2.0)


def test_fit_recovers_the_coefficients_and_predicts_other_batches():
    pts = _probe_points(_TRUE, [(1, 32760, 512), (20, 1560, 512), (1, 7800, 512)])
    fitted = ActivationMemory.fit(30, pts)
    for shape in [(1, 26520, 512), (17, 1560, 512), (3, 7800, 512), (1, 1560, 0)]:
        for k in (0, 7, 30):
            assert fitted.peak_bytes(*shape, k) == pytest.approx(_TRUE.peak_bytes(*shape, k), rel=1e-9)


def test_fit_refuses_points_that_do_not_separate_the_terms():
    with pytest.raises(ValueError, match="at least 5"):
        ActivationMemory.fit(30, _probe_points(_TRUE, [(1, 32760, 512), (20, 1560, 512)])[:4])
    # One text-to-token ratio only: the text terms cannot be told from the token terms.
    with pytest.raises(ValueError, match="separate"):
        ActivationMemory.fit(30, _probe_points(_TRUE, [(1, 32760, 512), (2, 32760, 512), (1, 16380, 256)]))


def test_images_checkpoint_more_blocks_than_a_clip_of_the_same_tokens():
    budget = 70 * GIB
    clip = _TRUE.checkpointed_blocks(1, 32760, 512, budget)
    images = _TRUE.checkpointed_blocks(21, 1560, 512, budget)
    assert 0 <= clip < images <= 30
    for b, s, k in [(1, 32760, clip), (21, 1560, images)]:
        assert _TRUE.peak_bytes(b, s, 512, k) <= budget
        if k > 0:  # the fewest: one block fewer would not fit
            assert _TRUE.peak_bytes(b, s, 512, k - 1) > budget
    with pytest.raises(ValueError, match=r"4 x 32760 tokens .*lower max_tokens"):
        _TRUE.checkpointed_blocks(4, 32760, 512, 30 * GIB)


def test_dict_round_trip_and_named_errors():
    assert ActivationMemory.from_dict(_TRUE.to_dict()) == _TRUE
    bad = {**_TRUE.to_dict(), "tokens_all": 1.0}
    bad.pop("token_all")
    with pytest.raises(ValueError, match=r"missing keys \['token_all'\], unknown keys \['tokens_all'\]"):
        ActivationMemory.from_dict(bad)


# -- the model's "auto" mode ---------------------------------------------------------------------------------

# A tiny model (4 blocks) whose memory model makes a long sample need 1 checkpointed block and a batch of short
# samples with the same tokens need 3: the text term per sample decides.
_TINY = ActivationMemory(num_blocks=4, base_bytes=0.0, token_all=1.0, text_all=1.0, token_block=1.0,
                         text_block=2.0)  # fmt: skip


def test_auto_mode_checkpoints_per_batch_and_keeps_gradients():
    model = _model(num_layers=4)
    ref = _model(num_layers=4)
    # clip: B=1, 4 frames -> 16 tokens, text 5; images: B=4, 1 frame -> 4 tokens each, text 5.
    clip_peak = _TINY.peak_bytes(1, 16, 5, 1)
    model.set_activation_checkpointing(
        True, "save_attention", "auto", memory=_TINY.to_dict(), budget_bytes=clip_peak
    )
    assert _TINY.checkpointed_blocks(1, 16, 5, clip_peak) == 1
    assert _TINY.checkpointed_blocks(4, 4, 5, clip_peak) == 3
    for (b, t), want in [((1, 4), 1), ((4, 1), 3), ((1, 4), 1)]:
        x, ts, ctx = _inputs(b, t)
        out, got = _grads(model, x, ts, ctx)
        assert model.last_checkpointed_blocks == want
        assert sum(blk.checkpoint_policy == "save_attention" for blk in model.blocks) == want
        out_ref, want_grads = _grads(ref, x, ts, ctx)
        torch.testing.assert_close(out, out_ref)
        for name in want_grads:
            torch.testing.assert_close(got[name], want_grads[name], msg=name)
    # eval leaves the blocks alone; an explicit count turns "auto" off
    model.eval()
    with torch.no_grad():
        model(*_inputs(4, 1))
    assert model.last_checkpointed_blocks == 1
    model.train().set_activation_checkpointing(True, "full", 2)
    model(*_inputs(4, 1))
    assert model.last_checkpointed_blocks is None
    assert [blk.checkpoint_policy for blk in model.blocks] == ["full", None, "full", None]


def test_auto_mode_needs_a_memory_model_for_this_depth():
    model = _model(num_layers=4)
    with pytest.raises(ValueError, match="needs memory"):
        model.set_activation_checkpointing(True, "full", "auto")
    with pytest.raises(ValueError, match="for 30 blocks, the model has 4"):
        model.set_activation_checkpointing(True, "full", "auto", memory=_TRUE, budget_bytes=1.0)
    # Predicted over the budget even fully checkpointed: every block, one warning per batch shape.
    model.set_activation_checkpointing(True, "full", "auto", memory=_TINY, budget_bytes=1.0)
    with pytest.warns(UserWarning, match="lower max_tokens.*checkpointing every block"):
        model(*_inputs(1, 4))
    assert model.last_checkpointed_blocks == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(*_inputs(1, 4))  # the same batch again: no second warning
        model(*_inputs(1, 4, text=9))  # nor for another text length (they vary by sample)
    with pytest.warns(UserWarning, match="lower max_tokens"):
        model(*_inputs(1, 2))  # another length warns


def _saved_bytes(model, shape, text):
    """Bytes of the distinct tensors autograd keeps for the backward of one forward: a CPU stand-in for the
    CUDA peak (checkpointed regions keep theirs behind the checkpoint's own hooks, so they do not count)."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return t

    b, _, tt, h, w = shape
    x, ts, ctx = _inputs(b, tt, h, w, text=text)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, ts, ctx)
    out.square().mean().backward()
    model.zero_grad(set_to_none=True)
    return float(sum(seen.values()))


def test_probe_fits_measured_memory_and_restores_the_setting():
    model = _model(num_layers=4)
    model.set_activation_checkpointing(True, "save_attention", num_blocks=1)
    before = [blk.checkpoint_policy for blk in model.blocks]

    def peak_of(shape, text):
        return _saved_bytes(model, shape, text)

    batches = [((1, 16, 6, 8, 8), 5), ((6, 16, 1, 8, 8), 5), ((1, 16, 2, 4, 4), 5)]
    fitted, points = probe_activation_memory(model, peak_of, batches, counts=(4, 2, 0))
    assert [blk.checkpoint_policy for blk in model.blocks] == before
    assert len(points) == 9 and {p.checkpointed for p in points} == {0, 2, 4}
    assert fitted.token_block > 0 and fitted.num_blocks == 4
    # Each block left un-checkpointed keeps more, and the fit predicts an unmeasured batch.
    for b, t in [(2, 3), (3, 1)]:
        for k in (1, 3):
            model.set_activation_checkpointing(True, "save_attention", k)
            got = _saved_bytes(model, (b, 16, t, 8, 8), 5)
            assert fitted.peak_bytes(b, t * 16, 5, k) == pytest.approx(got, rel=0.15)


def test_compiled_auto_mode_stays_within_the_graph_bound():
    eager, compiled = _model(num_layers=4), _model(num_layers=4)
    for m in (eager, compiled):
        m.set_activation_checkpointing(True, "save_attention", "auto", memory=_TINY,
                                       budget_bytes=_TINY.peak_bytes(1, 16, 5, 1))  # fmt: skip
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_blocks(compiled, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b, t in [(1, 4), (4, 1), (1, 3), (3, 1), (1, 4)]:
            x, ts, ctx = _inputs(b, t)
            out_e, g_e = _grads(eager, x, ts, ctx)
            out_c, g_c = _grads(compiled, x, ts, ctx)
            assert compiled.last_checkpointed_blocks == eager.last_checkpointed_blocks
            torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
            for name in g_e:
                torch.testing.assert_close(g_c[name], g_e[name], rtol=1e-4, atol=1e-5, msg=name)
    # Two modes (checkpointed or not), each at most MAX_GRAPHS_PER_MODE graphs (B = 1 and B > 1).
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 2 * MAX_GRAPHS_PER_MODE, graphs


def _backward_matmuls(model, policy) -> int:
    """aten matmul calls while the backward runs (the recompute of checkpointed blocks included)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {"mm", "addmm", "bmm", "baddbmm"}

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in names:
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    model.set_activation_checkpointing(policy is not None, policy or "full")
    out = model(*_inputs(2, 2))
    with Count():
        out.square().mean().backward()
    model.zero_grad(set_to_none=True)
    return Count.calls


def test_save_matmuls_recomputes_no_matmul():
    model = _model(num_layers=2)
    none = _backward_matmuls(model, None)
    assert _backward_matmuls(model, "save_matmuls") == none
    assert _backward_matmuls(model, "save_attention") > none
    assert _backward_matmuls(model, "full") >= _backward_matmuls(model, "save_attention")


def test_probe_retries_a_count_that_runs_out_of_memory():
    model = _model(num_layers=4)
    batches = [((1, 16, 4, 4, 4), 5), ((4, 16, 1, 4, 4), 5), ((1, 16, 1, 4, 4), 5)]

    def peak_of(shape, text):
        k = sum(blk.checkpoint_policy is not None for blk in model.blocks)
        if k < 3 and model.blocks[0].checkpoint_policy is not None:
            raise torch.OutOfMemoryError("fake")
        return _TINY.peak_bytes(1, 16, 5, k) + k  # any numbers; the counts are what is checked

    fitted, points = probe_activation_memory(model, peak_of, batches, "full", (4, 1))
    assert [p.checkpointed for p in points] == [4, 3] * 3
    assert fitted.num_blocks == 4


# -- the LightningModule and its recipe ----------------------------------------------------------------------


def test_module_auto_checkpointing_reaches_the_model_and_checks_its_inputs():
    from lightning_adaptiveload.models.module import MemorySettings, VideoDiTModule

    overrides = {**_CFG, "num_layers": 4}
    module = VideoDiTModule(
        preset="tiny",
        model_overrides=overrides,
        memory=MemorySettings(
            activation_checkpointing=True,
            checkpoint_policy="save_matmuls",
            checkpoint_blocks="auto",
            activation_memory=_TINY.to_dict(),
            memory_budget_gib=_TINY.peak_bytes(1, 16, 5, 1) / 2**30,
        ),
    )
    module.configure_model()
    module.model.train()
    module.model(*_inputs(4, 1))
    assert module.model.last_checkpointed_blocks == 3
    assert sum(b.checkpoint_policy == "save_matmuls" for b in module.model.blocks) == 3
    with pytest.raises(ValueError, match="needs activation_memory"):
        MemorySettings(activation_checkpointing=True, checkpoint_blocks="auto")
    with pytest.raises(ValueError, match=r"missing keys \['base_bytes'\]"):
        bad = {k: v for k, v in _TINY.to_dict().items() if k != "base_bytes"}
        MemorySettings(checkpoint_blocks="auto", activation_memory=bad)


def test_recipe_accepts_auto_checkpointing(capsys):
    import yaml

    from lightning_adaptiveload.cli import main as cli

    recipe = str(ROOT / "recipes" / "quickstart.yaml")
    if not os.path.exists(recipe):
        pytest.skip("recipes/ not in this checkout")
    memory = "{" + ", ".join(f"{k}: {v}" for k, v in _TRUE.to_dict().items()) + "}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(
            [
                "fit",
                "--config",
                recipe,
                "--model.init_args.memory.checkpoint_blocks=auto",
                f"--model.init_args.memory.activation_memory={memory}",
                "--model.init_args.memory.memory_budget_gib=70",
                "--print_config",
            ]
        )
    assert exit_info.value.code in (0, None)
    args = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]["memory"]
    assert args["checkpoint_blocks"] == "auto" and args["activation_memory"]["num_blocks"] == 30


# -- the whole forward compiled, blocks as nested regions ------------------------------------------------


def test_compile_whole_matches_eager_and_traces_each_block_as_a_region():
    from lightning_adaptiveload.models.acceleration import compile_whole

    eager, model = _model(num_layers=3), _model(num_layers=3)
    for m in (eager, model):
        m.set_activation_checkpointing(False)
    torch._dynamo.reset()
    nodes = []

    def count(gm, example_inputs):
        nodes.append(sum("invoke_subgraph" in str(n.target) for n in gm.graph.nodes))
        return gm

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compile_whole(model, backend=count)(*_inputs(1, 2))
    assert nodes == [3]  # one region call per block, in one graph
    torch._dynamo.reset()
    compiled = compile_whole(model, backend="aot_eager")
    x, ts, ctx = _inputs(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = compiled(x, ts, ctx)
    out.square().mean().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    out_ref, want = _grads(eager, x, ts, ctx)
    torch.testing.assert_close(out.detach(), out_ref, rtol=1e-4, atol=1e-5)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)
    with pytest.raises(ValueError, match="no repeated blocks"):
        compile_whole(torch.nn.Linear(2, 2))


def test_calibrate_fits_auto_checkpointing_into_the_fragment():
    import yaml

    from lightning_adaptiveload.tools.calibrate import calibrate
    from lightning_adaptiveload.tools.calibrate_settings import (
        CalibratedTraining,
        CalibrateSettings,
        MemorySearch,
    )

    # Step time linear in the tokens (a time per sample that does not grow with its length has no fit with
    # alpha, beta >= 0 and alpha + beta > 0; whether lstsq's rounding found one depended on the BLAS).
    settings = CalibrateSettings(
        mix="tiny", num_shapes=3, warmup=1, repeats=1, packs=False,
        training=CalibratedTraining(
            device="cpu", activation_checkpointing=True, checkpoint_policy="save_matmuls", checkpoint_blocks="auto"
        ),
        memory=MemorySearch(max_tokens=900, memory_budget_gb=8.0),
    )  # fmt: skip
    timer = lambda shapes: 1e-6 * sum(t * h * w for _, t, h, w in shapes)  # noqa: E731
    result = calibrate("tiny", settings=settings, progress=False, timer=timer)
    model_args = yaml.safe_load(result.to_yaml())["model"]["init_args"]
    args = model_args["memory"]  # the module's MemorySettings group
    assert args["activation_checkpointing"] is True
    assert args["checkpoint_blocks"] == "auto" and args["checkpoint_policy"] == "save_matmuls"
    assert args["memory_budget_gib"] == 8.0
    memory = ActivationMemory.from_dict(args["activation_memory"])
    assert memory.num_blocks == 2 and memory.base_bytes > 0
    assert "count per batch (auto)" in result.to_yaml()
    assert "compile" not in model_args  # measured eagerly: nothing to carry


def test_calibration_bench_with_bf16_weights_uses_master_weights_and_counts_them():
    from lightning_adaptiveload.models.master_weights import MasterWeightAdamW
    from lightning_adaptiveload.models.module import OptimizerSettings, VideoDiTModule
    from lightning_adaptiveload.tools.calibrate_bench import Bench

    benches = {}
    for dtype in ("fp32", "bf16"):
        module = VideoDiTModule(preset="tiny", optimizer=OptimizerSettings(weight_dtype=dtype))
        module.configure_model()
        benches[dtype] = Bench(module, torch.device("cpu"), "bf16-mixed", 4, True, 0)  # from weight_dtype
    fp32, bf16 = benches["fp32"], benches["bf16"]
    n = fp32.num_params
    assert isinstance(bf16.optimizer, MasterWeightAdamW) and not isinstance(fp32.optimizer, MasterWeightAdamW)
    # fp32: weights, gradients and two moments, 4 bytes each; bf16: 2 + 2, then the fp32 master and moments.
    assert fp32.static_bytes == 16 * n and bf16.static_bytes == 16 * n
    assert fp32.ddp_bytes == 4 * n and bf16.ddp_bytes == 2 * n


def test_a_compiled_calibration_sets_compile_and_weight_dtype_in_the_fragment():
    import yaml

    from lightning_adaptiveload.tools.calibrate import calibrate
    from lightning_adaptiveload.tools.calibrate_settings import (
        CalibratedTraining,
        CalibrateSettings,
        MemorySearch,
    )

    def fragment(**training):
        settings = CalibrateSettings(
            mix="tiny", num_shapes=3, warmup=1, repeats=1, packs=False,
            training=CalibratedTraining(device="cpu", **training), memory=MemorySearch(max_tokens=900),
        )  # fmt: skip
        timer = lambda shapes: 1e-6 * sum(t * h * w for _, t, h, w in shapes)  # noqa: E731
        return yaml.safe_load(calibrate("tiny", settings=settings, progress=False, timer=timer).to_yaml())

    assert fragment(compile=True)["model"]["init_args"] == {
        "compile": True
    }  # the budget was measured compiled
    both = fragment(compile=True, weight_dtype="bf16")
    assert both["model"]["init_args"] == {"compile": True, "optimizer": {"weight_dtype": "bf16"}}
    assert "model" not in fragment()
    with pytest.raises(ValueError, match="needs activation_checkpointing"):
        CalibratedTraining(device="cpu", checkpoint_blocks="auto")

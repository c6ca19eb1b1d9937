"""Packs under regional torch.compile: an epoch whose pack composition changes at every step compiles a
bounded number of block graphs, and the compiled model equals eager mode (CPU, ``aot_eager``, fp32).

``aot_eager`` runs Dynamo and AOTAutograd, the parts that decide graph breaks, recompiles and what a
checkpoint keeps; inductor adds code generation (and size guards of its own on GPUs, see
``models/acceleration.py``).
"""

from __future__ import annotations

import logging
import random
import warnings

import pytest
import torch
import torch._dynamo

from lightning_adaptiveload.models import acceleration
from lightning_adaptiveload.models.acceleration import compile_blocks, compiled_graphs
from lightning_adaptiveload.models.packing import attention_route
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

# Text lengths avoid 6 and the model's widths: dynamo's duck sizing would give a text length equal to another
# size (the six modulation rows) that size's symbol, which is then specialised.
_CFG = dict(dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=32)
_GRIDS = [(1, 4, 4), (2, 4, 4), (1, 4, 6), (3, 2, 2), (1, 2, 4), (2, 2, 6), (1, 6, 6)]
# A mixed pack's graph (any composition, any text length) and the batch graphs of the pack of one (B = 1)
# and of the equal-length pack (B > 1). From torch 2.13 no pack compiles again when its sizes differ.
# torch 2.11 (the GPU image, run 58) compiled 6 of the 12 packs of the first test: a mixed pack of another
# sample count compiled again (not read further; the 2 x H200 packed runs under inductor on that torch
# compiled 4 kinds of batch in 165 steps). There the bound is only "not every pack".
_TORCH_2_13 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
MAX_PACK_GRAPHS = 3 if _TORCH_2_13 else 8


def _model() -> VideoDiT:
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny", **_CFG)).train()
    torch.nn.init.normal_(model.head.head.weight, std=0.02)  # non-zero gradients everywhere
    model.set_activation_checkpointing(True, "save_attention")
    return model


def _packs(count: int = 12, seed: int = 0):
    """``count`` packs, each of a new composition: mixed lengths mostly, a pack of one and equal lengths."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    compositions = [[rng.choice(_GRIDS) for _ in range(rng.randint(2, 5))] for _ in range(count)]
    compositions[3] = [(1, 6, 6)]  # a pack of one: the bucketed batch
    compositions[7] = [(1, 4, 4), (1, 4, 4), (1, 4, 4)]  # equal lengths: a batch of three
    seen = set()
    for comp in compositions:
        assert tuple(comp) not in seen
        seen.add(tuple(comp))
        n = len(comp)
        text_len = rng.choice([3, 4, 5, 7, 9])
        mask = torch.rand(n, text_len, generator=g) > 0.3
        mask[:, 0] = True
        yield (
            [torch.randn(16, *grid, generator=g) for grid in comp],
            torch.rand(n, generator=g) * 1000,
            torch.randn(n, text_len, _CFG["text_dim"], generator=g),
            mask,
        )


def _step(model: VideoDiT, latents, t, text, mask):
    model.zero_grad(set_to_none=True)
    out = model(latents, t, text, mask)
    sum(o.square().sum() for o in out).backward()
    return [o.detach() for o in out], {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def test_changing_pack_compositions_compile_a_bounded_number_of_graphs(caplog):
    eager, compiled = _model(), _model()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    before = compiled_graphs()
    assert compile_blocks(compiled, backend="aot_eager") == 2
    routes = set()
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger=acceleration.__name__):
        warnings.simplefilter("ignore")  # the checkpoint-under-compile notice
        for latents, t, text, mask in _packs():
            routes.add(attention_route([g.shape[1] * g.shape[2] * g.shape[3] // 4 for g in latents]))
            out_e, grads_e = _step(eager, latents, t, text, mask)
            out_c, grads_c = _step(compiled, latents, t, text, mask)
            for a, b in zip(out_c, out_e):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert grads_c.keys() == grads_e.keys()
            for name in grads_e:
                torch.testing.assert_close(
                    grads_c[name], grads_e[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
                )
    assert routes == {"dense", "segments"}
    graphs = compiled_graphs() - before
    # The pack's tensors and the text length are dynamic from the first graph (2 x H200 and 4 x H200 runs
    # compiled again at the second pack, the second text length and the first unaligned one before).
    assert 1 <= graphs <= MAX_PACK_GRAPHS, graphs
    # Every new graph was logged, with the input that made it.
    log = compiled.graph_log
    assert sum(1 for _ in log.events) >= 1 and log.graphs == compiled_graphs()
    lines = [
        r.getMessage()
        for r in caplog.records
        if r.name == acceleration.__name__ and "new graph" in r.getMessage()
    ]
    assert len(lines) == len(log.events)
    assert any("pack of" in line for line in lines)


@pytest.mark.cuda
def test_packs_under_inductor_on_cuda_match_eager_with_bounded_graphs():
    # Inductor adds size guards of its own (models/acceleration.py), so the bound is looser than aot_eager's.
    eager, compiled = _model().cuda(), _model().cuda()
    torch._dynamo.reset()
    before = compiled_graphs()
    compile_blocks(compiled)
    for latents, t, text, mask in _packs(count=8):
        latents, t, text, mask = [x.cuda() for x in latents], t.cuda(), text.cuda(), mask.cuda()
        results = []
        for model in (eager, compiled):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                results.append(_step(model, latents, t, text, mask))
        (out_e, grads_e), (out_c, grads_c) = results
        for a, b in zip(out_c, out_e):
            assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2
        for name in grads_e:
            rel = (grads_c[name].float() - grads_e[name].float()).norm() / grads_e[name].float().norm()
            assert rel < 5e-2, (name, float(rel))
    assert compiled_graphs() - before <= 2 * MAX_PACK_GRAPHS


@torch.library.custom_op("adaptiveload_test::varlen_stand_in", mutates_args=())
def _varlen_stand_in(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """The variable-length kernel's contract on CPU: (S, H, d) queries, each segment attending to its keys."""
    out = torch.zeros_like(q)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        if cq[i + 1] > cq[i] and ck[i + 1] > ck[i]:
            qi, ki, vi = (
                x.transpose(0, 1) for x in (q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]])
            )
            out[cq[i] : cq[i + 1]] = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi).transpose(
                0, 1
            )
    return out


@_varlen_stand_in.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k):
    return torch.empty_like(q)


def test_packs_through_the_varlen_route_compile_one_graph_for_every_composition(monkeypatch):
    """The CUDA route of mixed packs (the variable-length cross-attention over ``cu_seqlens`` and the text
    offsets), on CPU through a stand-in of the kernel: pack sizes, sample counts and text lengths (aligned to
    8 or not) change at every step, and one graph serves them all (4 x H200: a new sample count and the
    first unaligned text length each compiled again, 7-23 s a time)."""
    from lightning_adaptiveload.models import packing

    monkeypatch.setattr(packing, "_varlen_attn", _varlen_stand_in)
    monkeypatch.setattr(packing, "_varlen_applies", lambda q: True)
    monkeypatch.setattr(packing, "varlen_applies_to", lambda device, dtype: True)
    eager, compiled = _model().eval(), _model().eval()
    torch._dynamo.reset()
    compile_blocks(compiled, backend="aot_eager")
    before = compiled_graphs()
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    mixed = [(1, 4, 4), (2, 4, 4), (1, 4, 6), (3, 2, 2), (1, 2, 4), (2, 2, 6)]
    with torch.no_grad():
        for step, text_len in enumerate([5, 8, 13, 3, 16, 9, 7, 11]):
            n = 2 + step % 5
            comp = [mixed[(step + i) % len(mixed)] for i in range(n)]
            latents = [torch.randn(16, *grid, generator=g) for grid in comp]
            mask = torch.rand(n, text_len, generator=g) > 0.3
            mask[:, 0] = True
            args = (
                latents,
                torch.rand(n, generator=g) * 1000,
                torch.randn(n, text_len, 16, generator=g),
                mask,
            )
            for a, b in zip(compiled.forward_packed(*args), eager.forward_packed(*args)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            assert rng is not None
    assert compiled_graphs() - before == 1

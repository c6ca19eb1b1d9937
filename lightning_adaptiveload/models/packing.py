"""Packed sequences: samples of any shapes run as one step, each attending only to itself.

A *pack* (the ``packed`` schedule's batch, see ``docs/data_path.md``) holds N samples of different latent
shapes. :class:`~lightning_adaptiveload.models.video_dit.VideoDiT` takes it through its own ``forward``
(``model([x_0, x_1, ...], t)``; ``forward_packed`` is an alias), so FSDP's hooks, compiled blocks and user
hooks see packs as they see batches. It keeps every sample apart where samples could mix:

- **positions**: each sample's 3-D RoPE angles start at its own (0, 0, 0) (:func:`packed_rope`);
- **self-attention**: confined to each sample (block-diagonal; :func:`segment_attention`);
- **cross-attention**: each sample's tokens attend to its own text only;
- **timestep modulation**: per sample, from its own timestep;
- **loss**: summed per token, so a pack and the same samples as separate batches give the same loss.

Two routes (:func:`attention_route`, logged once per route and device):

- ``"dense"``: every sample has the same token count (a pack of one sample included). The pack *is* a
  batch: tokens (N, L, D), modulation (N, 1, D) rows broadcast per sample, batched SDPA, the head per
  sample, exactly the bucketed path's kernels (a pack of one 32,760-token clip runs what the bucketed
  batch of that clip runs).
- ``"segments"``: mixed lengths. The tokens are one sequence (1, S, D) described by a
  :class:`PackSegments`; the per-sample modulation rows are spread to tokens by :func:`segment_rows`, whose
  backward is a segment sum (never the sort-based backward of an advanced-index gather, which took 60% of a
  packed step on an H200: ``indexing_backward_kernel``). Self-attention runs as one dense kernel call per
  run of equal-length samples (:mod:`.pack_attention`, eager and compiled); where no dense kernel applies,
  the variable-length kernel on CUDA (``torch.nn.attention.varlen``, bf16/fp16), per-sample SDPA elsewhere,
  and a block-diagonal mask inside ``torch.compile``. Cross-attention runs through the varlen kernel on
  CUDA (bf16/fp16); elsewhere per sample in eager mode and with a block mask inside ``torch.compile``.

Under ``torch.compile`` (``compile_blocks``) nothing that describes the pack's composition enters a block's
graph as a Python value: offsets and segment ids are tensors and the longest sample is a symbolic int, so
one graph serves every mixed pack (``tests/models/test_packing_compile.py`` bounds the graphs over 12 packs).

Helpers a user's own model needs to adopt the contract: :func:`cu_seqlens` (token offsets),
:func:`segment_ids` (sample of every token), :func:`packed_rope` (per-sample positions),
:func:`segment_attention` (exact on CPU, variable-length kernels on CUDA where torch has them) and
:func:`segment_rows` / :func:`segment_sum` (per-sample values to tokens and back). Plain PyTorch: no
Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from lightning_adaptiveload.models import attention as _attention
from lightning_adaptiveload.models import pack_attention as _pack_attention

try:  # torch >= 2.10; imported here, not inside functions that torch.compile traces
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:
    _varlen_attn = None

__all__ = [
    "ATTENTION_ROUTES",
    "SEGMENT_SUMS",
    "PackSegments",
    "attention_route",
    "cu_seqlens",
    "flow_loss_packed",
    "packed_forward",
    "packed_rope",
    "segment_attention",
    "segment_cross_attention",
    "segment_ids",
    "segment_rows",
    "segment_self_attention",
    "segment_sum",
    "varlen_attention_available",
]


log = logging.getLogger(__name__)

ATTENTION_ROUTES = ("dense", "segments")
_logged_routes: set[tuple[str, str, bool]] = set()

#: How :func:`segment_rows` can sum its gradient back to the rows (:func:`segment_sum`): ``"splits"`` (one
#: column sum per sample over host offsets; eager only), ``"matmul"`` (a (N, S) one-hot matrix times the
#: gradient: one GEMM, deterministic; with TF32 allowed its inputs are rounded to TF32), ``"index_add"``
#: (atomic adds, not deterministic on CUDA), ``"index"`` (the advanced-index gather ``rows[seg]`` whose
#: sort-based CUDA backward is the slow one). ``"auto"``: ``"splits"`` in eager mode, ``"matmul"`` inside
#: ``torch.compile`` (where host offsets would bake the pack's composition into the graph).
SEGMENT_SUMS = ("auto", "splits", "matmul", "index_add", "index")

#: How a mixed pack's self-attention can run: ``"runs"`` (each run of equal-length samples as one dense
#: kernel call inside one custom op, :mod:`.pack_attention`: the bucketed batch's kernel, eager and
#: compiled), ``"varlen"`` (one variable-length kernel for the whole pack, ``torch.nn.attention.varlen``,
#: CUDA only), ``"per_sample"`` (the same runs as SDPA calls in Python; eager mode only), ``"auto"``:
#: ``"runs"`` where :func:`.pack_attention.runs_kernel` finds a kernel, else the previous routes.
SEGMENT_ATTENTIONS = ("auto", "runs", "varlen", "per_sample")


# The package always takes "auto". The three choices below are functions, not settings, so that nothing a
# user can set changes the route; benchmarks and tests compare the other routes by patching them
# (``benchmarks/model/pack_routes.py``).
def _segment_sum_route() -> str:
    return "auto"


def _segment_attention_route() -> str:
    return "auto"


def _force_segments() -> bool:
    return False


def attention_route(seq_lens: Sequence[int]) -> str:
    """How a pack runs: ``"dense"`` when all its samples have one token count, else ``"segments"``.

    ``"dense"``: the pack is a batch (N, S, ...) and runs the bucketed path (batched SDPA, per-sample
    modulation rows). ``"segments"``: one sequence of all tokens, described by :class:`PackSegments`; self-
    and cross-attention are confined to each sample. Text lengths do not enter the choice: both routes
    attend to the same zero-padded text through the same mask, so the dense route is exact for any text
    lengths.

    Args:
        seq_lens: the N token counts of the pack (host ints).
    """
    if len(seq_lens) == 0:
        raise ValueError("attention_route: a pack holds at least one sample")
    if _force_segments():
        return "segments"
    return "dense" if len({int(s) for s in seq_lens}) == 1 else "segments"


def log_route_once(route: str, device: torch.device, varlen: bool, n: int) -> None:
    """One INFO line per (route, device type, kernel family), not per step: which path a run takes is a
    setting of its data, and the varlen kernel's speed differs from SDPA's by up to 3x either way."""
    varlen = route == "segments" and varlen
    key = (route, device.type, varlen)
    if key in _logged_routes:
        return
    _logged_routes.add(key)
    kernel = None
    if route == "segments" and _segment_attention_route() in ("auto", "runs") and device.type in ("cpu", "cuda"):
        kernel = _pack_attention.runs_kernel(device, None)
    if route == "dense":
        what = f"a batch of {n} equal-length samples through batched SDPA"
    else:
        if kernel is not None:
            what = f"mixed lengths, self-attention one {kernel} kernel call per run of equal-length samples"
        elif varlen:
            what = (
                "mixed lengths, self-attention through the variable-length kernel (torch.nn.attention.varlen)"
            )
        else:
            what = "mixed lengths, self-attention through SDPA per sample"
        what += ", cross-attention " + ("variable-length" if varlen else "per sample")
    log.info("packed attention on %s: %s", device.type, what)


# --------------------------------------------------------------------------------------------------
# Offsets and segment ids
# --------------------------------------------------------------------------------------------------


def cu_seqlens(
    seq_lens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """Token offsets of a pack: ``[0, S_0, S_0 + S_1, ...]`` as int32 (N + 1,), FlashAttention's layout."""
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device)
    return F.pad(torch.cumsum(lens, 0), (1, 0)).to(torch.int32)


def segment_ids(
    seq_lens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
) -> torch.Tensor:
    """The sample index of every token of a pack: int64 (sum S_i,), e.g. ``[0, 0, 0, 1, 1]`` for (3, 2).

    From host ints no device-to-host copy happens (the total is known); from a CUDA tensor of lengths,
    ``repeat_interleave`` reads the total back once.
    """
    lens = torch.as_tensor(seq_lens, dtype=torch.int64, device=device)
    total = None if isinstance(seq_lens, torch.Tensor) else int(sum(int(s) for s in seq_lens))
    return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens, output_size=total)


def packed_rope(
    model: Any, grids: Sequence[tuple[int, int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of every sample's own 3-D RoPE, concatenated: each (sum S_i, d/2) float32.

    Args:
        model: a :class:`~lightning_adaptiveload.models.video_dit.VideoDiT` (its per-grid RoPE cache).
        grids: per sample, its token grid (F, H', W').
        device: where the tables live.
    """
    parts = [model._rope(tuple(int(v) for v in g), device) for g in grids]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


@dataclass(frozen=True, eq=False)
class PackSegments:
    """Where each sample of a mixed pack lies in its token sequence: what a block needs to keep samples apart.

    Built once per pack (:meth:`build`, by ``VideoDiT.forward``) and passed to every block, attention layer
    and the head (``segments=``). Tensors live on the pack's device.

    Attributes:
        lens: the N token counts, host ints. Read in eager mode only (per-sample loops, column sums), never
            inside ``torch.compile``, so that a compiled block's graph does not depend on the composition.
        seg: int64 (S,): the sample of every token (:func:`segment_ids`).
        cu: int32 (N + 1,): token offsets (:func:`cu_seqlens`).
        max_len: the longest sample's token count (the varlen kernel's bound; symbolic under compile).
        text_order: int64 (N * L,) or None: positions of the padded text (N, L) flattened, each sample's
            real tokens first and in order, all padding after the last sample's; the varlen cross-attention
            reads keys in this order up to ``text_cu[N]``. None where the varlen kernel cannot run.
        text_cu: int32 (N + 1,) or None: offsets of each sample's real text tokens in that order.
        text_max: the padded text length L (an upper bound of each sample's real text, as the kernel needs).
        text_keys: bool (N * L,) or None: True at the first ``text_cu[N]`` positions of that order, the keys
            the kernel reads. Its backward leaves the gradient of the other keys unwritten (uninitialised
            memory, not zeros: a mixed pack's loss went NaN on 2 x H200), so
            :func:`segment_cross_attention` drops it through this mask.
        has_text: bool (S,) or None: whether the token's sample has any real text (a sample without text
            gets a zero cross-attention output, as in the bucketed path); None: all have.
        runs: CPU int64 (R, 2): the pack's runs of equal-length samples as (length, count), the input of
            :func:`.pack_attention.pack_runs_attention` (a tensor, so that compiled blocks do not depend on
            the composition).
    """

    lens: tuple[int, ...]
    seg: torch.Tensor
    cu: torch.Tensor
    max_len: int
    text_order: torch.Tensor | None = None
    text_cu: torch.Tensor | None = None
    text_max: int = 0
    has_text: torch.Tensor | None = None
    text_keys: torch.Tensor | None = None
    runs: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        lens: Sequence[int],
        device: torch.device | str,
        text_mask: torch.Tensor | None = None,
        text_len: int = 0,
        varlen_text: bool = False,
    ) -> PackSegments:
        """The description of a pack of samples with ``lens`` tokens, without a device-to-host copy.

        Args:
            lens: the N token counts (host ints).
            device: where the pack's tokens are.
            text_mask: (N, L) bool, True at real text tokens, or None (all real, or no text).
            text_len: L, the padded text length (0: no text).
            varlen_text: also build the key order and offsets of the variable-length cross-attention.
        """
        lens = tuple(int(s) for s in lens)
        device = torch.device(device)
        seg = segment_ids(lens, device)
        cu = cu_seqlens(lens, device)
        text_order = text_cu = has_text = text_keys = None
        if text_mask is not None:
            has_text = text_mask.any(dim=-1).index_select(0, seg)
        if varlen_text and text_len > 0:
            n = len(lens)
            if text_mask is None:
                counts = torch.full((n,), text_len, dtype=torch.int64, device=device)
                text_order = torch.arange(n * text_len, device=device)
            else:
                counts = text_mask.sum(dim=-1)
                # Real tokens first (stable: in order, sample by sample), then every padding position.
                text_order = torch.argsort((~text_mask).flatten().to(torch.int8), stable=True)
            text_cu = F.pad(torch.cumsum(counts, 0), (1, 0)).to(torch.int32)
            text_keys = torch.arange(n * text_len, device=device) < text_cu[-1]
        runs = _pack_attention.runs_tensor(lens)
        # Sizes that follow the composition (N + 1 offsets, S tokens, N * L text positions, R runs) are
        # dynamic from a compiled block's first pack: left to dynamo, they were static in the first graph
        # (these tensors are attributes, not arguments), so the second pack compiled again (19 s, 4 x H200).
        mark_dynamic((seg, cu, text_order, text_cu, has_text, text_keys, runs), 0)
        return cls(lens, seg, cu, max(lens), text_order, text_cu, int(text_len), has_text, text_keys, runs)

    @property
    def num_samples(self) -> int:
        return self.cu.shape[0] - 1


# --------------------------------------------------------------------------------------------------
# Per-sample values to tokens, and gradients back
# --------------------------------------------------------------------------------------------------


def mark_dynamic(tensors: Sequence[torch.Tensor | None], dim: int) -> None:
    """Ask ``torch.compile`` to treat dimension ``dim`` of each tensor (None skipped) as dynamic in the first
    graph it compiles for them (``torch._dynamo.maybe_mark_dynamic``): sizes that change by batch. A no-op
    inside a compiled region (a model compiled whole traces this code)."""
    if torch.compiler.is_compiling():
        return
    for t in tensors:
        if t is not None:
            torch._dynamo.maybe_mark_dynamic(t, dim)


def segment_sum(
    values: torch.Tensor,
    seg: torch.Tensor,
    num_segments: int,
    lens: Sequence[int] | None = None,
    how: str = "matmul",
) -> torch.Tensor:
    """Sum the rows of each segment: (S, ...) -> (N, ...), ``out[i] = values[seg == i].sum(0)``.

    Args:
        values: (S, ...) float, the segments' rows back to back (segment i is rows ``cu[i]:cu[i+1]``).
        seg: int64 (S,), each row's segment (:func:`segment_ids`), non-decreasing.
        num_segments: N.
        lens: the N segment lengths as host ints; needed by ``how="splits"``.
        how: ``"splits"`` (a column sum per segment: exact fp32 sums, N kernels), ``"matmul"`` (one-hot
            (N, S) @ values: one GEMM; rounded to TF32 where TF32 matmuls are allowed) or ``"index_add"``
            (atomic adds; on CUDA the order, hence the last bits, vary from run to run).

    Returns:
        (N, ...) in values' dtype.
    """
    if how == "splits":
        if lens is None:
            raise ValueError("segment_sum(how='splits') needs the segment lengths as host ints (lens=...)")
        return torch.stack([part.sum(0) for part in values.split(list(lens))])
    if how == "matmul":
        flat = values.reshape(values.shape[0], -1)
        onehot = (torch.arange(num_segments, device=seg.device)[:, None] == seg[None, :]).to(flat.dtype)
        with torch.autocast(values.device.type, enabled=False):  # a sum: in values' dtype, never bf16
            return (onehot @ flat).reshape(num_segments, *values.shape[1:])
    if how == "index_add":
        return values.new_zeros(num_segments, *values.shape[1:]).index_add_(0, seg, values)
    raise ValueError(f"segment_sum: how must be 'splits', 'matmul' or 'index_add', got {how!r}")


class _SegmentRows(torch.autograd.Function):
    """``rows.index_select(0, seg)`` whose backward is :func:`segment_sum` (not a scatter per token)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, seg: torch.Tensor, lens: tuple[int, ...] | None, how: str):
        ctx.save_for_backward(seg)
        ctx.num_segments, ctx.lens, ctx.how = rows.shape[0], lens, how
        return rows.index_select(0, seg)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (seg,) = ctx.saved_tensors
        return segment_sum(grad, seg, ctx.num_segments, ctx.lens, ctx.how), None, None, None


def segment_rows(rows: torch.Tensor, segments: PackSegments) -> torch.Tensor:
    """Per-sample rows spread to the tokens of a pack: (N, D) -> (1, S, D), token s getting ``rows[seg[s]]``.

    The per-token layout ``(1, S, D)`` of ``NormModulate`` and of the fused op. The forward is a gather;
    the backward sums each sample's token gradients (:func:`segment_sum`, chosen by
    :func:`_segment_sum_route`), so that the gradient of a row that thousands of tokens share is one reduction,
    not thousands of scattered adds to one address.

    Args:
        rows: (N, D) float (fp32 modulation rows in the model).
        segments: the pack's :class:`PackSegments`.

    Returns:
        (1, S, D) in rows' dtype.
    """
    how = _segment_sum_route()
    if how not in SEGMENT_SUMS:
        raise ValueError(f"the segment sum route must be one of {list(SEGMENT_SUMS)}, got {how!r}")
    if how == "index":  # the old advanced-index gather (benchmarks: before/after)
        return rows[segments.seg][None]
    compiling = torch.compiler.is_compiling()
    if how == "auto" or (how == "splits" and compiling):
        how = "matmul" if compiling else "splits"
    lens = segments.lens if how == "splits" else None
    return _SegmentRows.apply(rows, segments.seg, lens, how)[None]


# --------------------------------------------------------------------------------------------------
# Attention within samples
# --------------------------------------------------------------------------------------------------


def varlen_attention_available() -> bool:
    """Whether this torch has ``torch.nn.attention.varlen.varlen_attn`` (the stock variable-length kernel).

    It appeared in torch 2.10 (docs 2.10 onward; CUDA only, FlashAttention-based; 2.10 has an ``is_causal``
    keyword, 2.12 on ``window_size``: only the positional arguments are used here); 2.9 and older lack it.
    """
    return _varlen_attn is not None


def _varlen_applies(q: torch.Tensor) -> bool:
    return q.is_cuda and varlen_attention_available() and q.dtype in (torch.float16, torch.bfloat16)


def varlen_applies_to(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the variable-length kernel runs for attention inputs of ``dtype`` on ``device``."""
    return device.type == "cuda" and varlen_attention_available() and dtype in (torch.float16, torch.bfloat16)


def _varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
) -> torch.Tensor:
    """``varlen_attn`` on (S, H, d) queries and (T, H, d) keys/values; returns (S, H, d)."""
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    lens: Sequence[int],
    backends: Any = None,
    varlen: bool = True,
) -> torch.Tensor:
    """Self-attention confined to each sample of a pack (block-diagonal), no mask materialised.

    Args:
        q, k, v: (1, H, S_total, d) of the packed sequence.
        cu: int32 (N + 1,) token offsets (:func:`cu_seqlens`).
        lens: the N sample lengths (host ints, to slice without a device sync).
        backends: SDPA kernel order for the per-sample path (see ``models/attention.py``).
        varlen: False: per-sample SDPA even where the variable-length kernel would run.

    Returns:
        (1, H, S_total, d). On CUDA with ``torch.nn.attention.varlen`` (torch >= 2.10) one variable-length
        kernel runs for the whole pack; elsewhere each sample's slice runs through SDPA, which is the
        per-sample computation exactly.
    """
    if varlen and _varlen_applies(q):
        m = max(int(s) for s in lens)
        qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # (S_total, H, d)
        return _varlen(qt, kt, vt, cu, cu, m, m).transpose(0, 1)[None]
    outs = []
    start = 0
    for length, count in _pack_attention.equal_runs(lens):
        end = start + length * count
        if count == 1:
            outs.append(
                _attention.sdpa(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], backends=backends)
            )
        else:  # a run of equal-length samples: one batched call (N, H, L, d), as a bucketed batch runs
            h, d = q.shape[1], q.shape[3]
            qs, ks, vs = (t[0, :, start:end].unflatten(1, (count, length)).transpose(0, 1) for t in (q, k, v))
            out = _attention.sdpa(qs, ks, vs, backends=backends)  # (count, H, L, d)
            outs.append(out.transpose(0, 1).reshape(1, h, count * length, d))
        start = end
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


def segment_self_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: PackSegments, backends: Any = None
) -> torch.Tensor:
    """Self-attention of a pack, each sample attending to itself: the layers' ``segments=`` path.

    Args:
        q, k, v: (1, H, S, d).
        segments: the pack's :class:`PackSegments`.
        backends: SDPA kernel order (``models/attention.py``) where SDPA runs.

    Returns:
        (1, H, S, d). By default (:func:`_segment_attention_route`) one dense kernel call per run of equal-length
        samples (:func:`.pack_attention.pack_runs_attention`, eager and compiled). Where no dense kernel
        applies: the varlen kernel on CUDA for bf16/fp16; per-sample SDPA in eager mode elsewhere; inside
        ``torch.compile`` elsewhere, SDPA with a block-diagonal (S, S) mask built from the segment ids.
    """
    route = _segment_attention_route()
    if route in ("auto", "runs") and segments.runs is not None:
        kernel = _pack_attention.runs_kernel(q.device, backends)
        if kernel is not None:
            return _pack_attention.pack_runs_attention(q, k, v, segments.runs, kernel)
    per_sample = route == "per_sample" or (route == "auto" and not torch.compiler.is_compiling())
    if per_sample and not torch.compiler.is_compiling():
        return segment_attention(q, k, v, segments.cu, segments.lens, backends, varlen=False)
    if per_sample:
        return _per_sample_attention(q, k, v, segments.cu, segments.lens, backends)
    if _varlen_applies(q):
        qt, kt, vt = (x[0].transpose(0, 1) for x in (q, k, v))  # (S, H, d)
        out = _varlen(qt, kt, vt, segments.cu, segments.cu, segments.max_len, segments.max_len)
        return out.transpose(0, 1)[None]
    if torch.compiler.is_compiling():
        same = segments.seg[:, None] == segments.seg[None, :]
        return _attention.sdpa(q, k, v, same[None, None], backends)
    return segment_attention(q, k, v, segments.cu, segments.lens, backends)


@torch.compiler.disable
def _per_sample_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, lens: Sequence[int], backends: Any
) -> torch.Tensor:
    # Host lengths slice the pack: eager only (a compiled block breaks its graph here, not per composition).
    return segment_attention(q, k, v, cu, lens, backends, varlen=False)


def segment_cross_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_mask: torch.Tensor | None,
    segments: PackSegments,
    attend: Callable[..., torch.Tensor],
    backends: Any = None,
) -> torch.Tensor:
    """Cross-attention of a pack: each sample's tokens attend to its own text only.

    Args:
        q: (1, H, S, d) the pack's queries.
        k, v: (N, H, L, d) each sample's text keys and values, zero padded to L.
        context_mask: (N, L) bool, True at real text tokens, or None (all real).
        segments: the pack's :class:`PackSegments`.
        attend: ``attend(q_i, k_i, v_i, mask_i)`` -> (1, H, S_i, d): one sample's masked cross-attention
            (``CrossAttention._attend``), for the per-sample loop of eager mode.
        backends: SDPA kernel order for the masked path.

    Returns:
        (1, H, S, d); zero for the tokens of a sample without real text (as in the bucketed path).
    """
    if segments.text_cu is not None and _varlen_applies(q):
        h, d = k.shape[1], k.shape[3]
        # (N * L, H, d), each sample's real tokens first: the kernel reads keys [text_cu[i], text_cu[i+1]).
        kt, vt = (x.transpose(1, 2).reshape(-1, h, d).index_select(0, segments.text_order) for x in (k, v))
        if segments.text_keys is not None:  # the padding keys' gradient is the kernel's garbage: keep it out
            keys = segments.text_keys[:, None, None]
            kt, vt = (torch.where(keys, x, x.detach()) for x in (kt, vt))
        out = _varlen(
            q[0].transpose(0, 1), kt, vt, segments.cu, segments.text_cu, segments.max_len, segments.text_max
        )
        if segments.has_text is not None:  # a sample without text attends to nothing: 0, never NaN
            out = torch.where(segments.has_text[:, None, None], out, out.new_zeros(()))
        return out.transpose(0, 1)[None]
    if torch.compiler.is_compiling():
        n, h, length, d = k.shape
        key_seg = torch.arange(n, device=k.device).repeat_interleave(length)  # (N * L,)
        allowed = segments.seg[:, None] == key_seg[None, :]  # (S, N * L)
        if context_mask is not None:
            allowed = allowed & context_mask.reshape(1, -1)
        keep = allowed.any(dim=-1)  # (S,)
        allowed = allowed | ~keep[:, None]  # a row without keys would make softmax NaN
        kf, vf = (x.transpose(0, 1).reshape(1, h, n * length, d) for x in (k, v))
        out = _attention.sdpa(q, kf, vf, allowed[None, None], backends)
        return out * keep[None, None, :, None].to(out.dtype)
    outs = []
    start = 0
    for i, s in enumerate(segments.lens):
        end = start + s
        mask = None if context_mask is None else context_mask[i : i + 1]
        outs.append(attend(q[:, :, start:end], k[i : i + 1], v[i : i + 1], mask))
        start = end
    return torch.cat(outs, dim=2)


# --------------------------------------------------------------------------------------------------
# A pack through a model, and its loss
# --------------------------------------------------------------------------------------------------


def packed_forward(
    model: Any,
    latents: Sequence[torch.Tensor],
    timestep: torch.Tensor,
    context: torch.Tensor | None = None,
    context_mask: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """``model(list(latents), timestep, context, context_mask)``: a pack through the model's own forward.

    Args:
        model: a :class:`~lightning_adaptiveload.models.video_dit.VideoDiT` (or a model with the same pack
            contract).
        latents: N noisy latents, each (C_in, T_i, H_i, W_i), any shapes divisible by the patch.
        timestep: (N,) per-sample diffusion time in the model's units.
        context: (N, L, text_dim) per-sample text, zero padded to the longest, or None.
        context_mask: (N, L) bool, True at each sample's real text states; None: all real.

    Returns:
        N predictions, each (C_out, T_i, H_i, W_i): the same as running each sample alone.
    """
    return model(list(latents), timestep, context, context_mask)


def flow_loss_packed(
    model: Any,
    latents: Sequence[torch.Tensor],
    t: torch.Tensor,
    noise: Sequence[torch.Tensor],
    num_train_timesteps: float,
    text: torch.Tensor | None,
    text_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """Summed per-token rectified-flow error of a pack: ``(sum over tokens of |v - (noise - x0)|^2 / e, tokens)``.

    ``e`` is the latent elements per token (C_in times the patch volume), as in the bucketed loss, so that
    a pack and the same samples as separate batches give the same sum (and, weighted by the global token
    count, the same loss and gradients). The model runs through its own ``forward`` (``model(list, t, ...)``).

    Args:
        model: the model (its ``config`` gives C_in and the patch volume).
        latents: N clean latents x0, each (C, T_i, H_i, W_i).
        t: (N,) rectified-flow times in [0, 1].
        noise: N noise tensors of the latents' shapes.
        num_train_timesteps: the model sees ``t * num_train_timesteps``.
        text, text_mask: (N, L, D) and (N, L) or None.
    """
    x0 = [x.float() for x in latents]
    x_t = [(1.0 - ti) * a + ti * z for a, z, ti in zip(x0, noise, t.float())]
    pred = model(x_t, t * num_train_timesteps, text, text_mask)
    cfg = model.config
    elems = cfg.in_channels * cfg.patch_volume
    err = sum((p.float() - (z - a)).square().sum() for p, z, a in zip(pred, noise, x0)) / elems
    tokens = sum(int(a.numel()) // elems for a in x0)
    return err, tokens

"""The measurement bench of ``calibrate``: the training model and its optimizer on one device.

Owns how one forward + backward is run at the training precision, how its peak memory is measured (the CUDA
allocator's peak, or on CPU an estimate from the tensors autograd saves) and how it is timed, with
out-of-memory reported as "does not fit" rather than raised. :mod:`lightning_adaptiveload.tools.calibrate`
drives it.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import nullcontext

import torch

__all__ = ["Bench", "auto_checkpointing", "physical_memory"]

_GIB = 1024**3


def _precision_context(precision: str, device: torch.device):
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "16-mixed":
        return torch.autocast(device.type, dtype=torch.float16)
    return nullcontext()


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return isinstance(err, RuntimeError) and "out of memory" in str(err).lower()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * _GIB


class Bench:
    """The model, its optimizer and the measurement primitives on one device."""

    def __init__(
        self,
        module,
        device: torch.device,
        precision: str,
        text_len: int,
        ddp: bool,
        seed: int,
    ):
        self.module = module
        self.device = device
        self.precision = precision
        self.text_len = text_len
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        model = module.model
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.num_params = sum(p.numel() for p in model.parameters())
        if module.optimizer_settings.weight_dtype == "bf16":  # the optimizer the module trains with
            from lightning_adaptiveload.models.master_weights import MasterWeightAdamW

            # Gradients (param dtype), then fp32 masters and AdamW's two fp32 moments.
            self.static_bytes = 2 * self.param_bytes + 12 * self.num_params
            self.ddp_bytes = self.param_bytes if ddp else 0  # DDP's buckets, in the gradients' dtype
            self.optimizer = MasterWeightAdamW(model.parameters(), lr=1e-12)
        else:
            # Gradients (param dtype) + AdamW's two moments (param dtype) on top of the parameters.
            self.static_bytes = 4 * self.param_bytes
            # DDP keeps its own fp32 gradient buckets (one more copy of the gradients).
            self.ddp_bytes = 4 * self.num_params if ddp else 0
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-12)
        self._pack: tuple[tuple, dict] | None = None  # the last pack's inputs, reused across its repeats

    def batch(self, shape: Sequence[int], b: int) -> dict:
        c, t, h, w = shape
        cfg = self.module.model_config
        pt, ph, pw = cfg.patch_size
        latents = torch.randn(b, c, t, h, w, generator=self.gen).to(self.device)
        text = mask = None
        if self.text_len > 0:
            text = torch.randn(b, self.text_len, cfg.text_dim, generator=self.gen).to(self.device)
            mask = torch.ones(b, self.text_len, dtype=torch.bool, device=self.device)
        s = (t // pt) * (h // ph) * (w // pw)
        return {"latents": latents, "text": text, "text_mask": mask, "num_tokens": b * s, "global_tokens": -1}

    def pack_batch(self, shapes: Sequence[Sequence[int]]) -> dict:
        """A packed batch (``docs/data_path.md``, "Packed batches") of one sample per latent shape."""
        cfg = self.module.model_config
        latents = [torch.randn(tuple(s), generator=self.gen).to(self.device) for s in shapes]
        text = mask = None
        if self.text_len > 0:
            text = torch.randn(len(shapes), self.text_len, cfg.text_dim, generator=self.gen).to(self.device)
            mask = torch.ones(len(shapes), self.text_len, dtype=torch.bool, device=self.device)
        return {"packed": True, "latents": latents, "text": text, "text_mask": mask, "global_tokens": -1}

    def time_pack(self, shapes: Sequence[Sequence[int]]) -> float | None:
        """Seconds of one forward + backward of a pack through the packed forward; None on out-of-memory.

        The inputs are drawn once per pack and reused while the same shapes are timed again (the
        ``timer`` of :func:`~lightning_adaptiveload.tools.calibrate_packs.time_packs`).
        """
        key = tuple(tuple(int(d) for d in s) for s in shapes)
        try:
            if self._pack is None or self._pack[0] != key:
                self._pack = None
                _release(self.device)
                self._pack = (key, self.pack_batch(key))
            return self.timed_step(self._pack[1])
        except Exception as err:  # noqa: BLE001 - only out-of-memory is expected here
            if not _is_oom(err):
                raise
            self._pack = None
            self.module.model.zero_grad(set_to_none=True)
            _release(self.device)
            return None

    def timed_step(self, batch: dict) -> float:
        """Seconds of one :meth:`step`: CUDA events on a GPU, the wall clock elsewhere."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.step(batch)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        t0 = time.perf_counter()
        self.step(batch)
        return time.perf_counter() - t0

    def step(self, batch: dict) -> None:
        self.module.model.zero_grad(set_to_none=True)
        with _precision_context(self.precision, self.device):
            loss, _ = self.module.compute_loss(batch)
        loss.backward()

    def allocate_optimizer_state(self, shape: Sequence[int]) -> None:
        self.step(self.batch(shape, 1))
        self.optimizer.step()
        self.module.model.zero_grad(set_to_none=True)

    def peak_bytes(self, shape: Sequence[int], b: int) -> int | None:
        """Peak memory of one forward + backward at (shape, b), or None on out-of-memory."""
        try:
            batch = self.batch(shape, b)
            if self.device.type == "cuda":
                self.module.model.zero_grad(set_to_none=True)
                torch.cuda.synchronize(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self.step(batch)
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = self.static_bytes + self._saved_bytes(batch)
            return peak + self.ddp_bytes
        except Exception as err:  # noqa: BLE001 - only out-of-memory is expected here
            if not _is_oom(err):
                raise
            return None
        finally:
            self.module.model.zero_grad(set_to_none=True)
            _release(self.device)

    def activation_memory(self, policy: str, batches: Sequence[tuple[Sequence[int], int]]):
        """Fit the model's :class:`~lightning_adaptiveload.models.memory.ActivationMemory` (for
        ``checkpoint_blocks="auto"``) from :meth:`peak_bytes` at each (latent shape (C, T, H, W), batch
        size), with every block and with half of them checkpointed under ``policy``. Returns (memory,
        points)."""
        from lightning_adaptiveload.models.acceleration import probe_activation_memory

        def peak_of(shape: Sequence[int], text_len: int) -> float:
            peak = self.peak_bytes(shape[1:], shape[0])
            if peak is None:
                raise torch.OutOfMemoryError(f"calibrate: {tuple(shape)} does not fit")
            return float(peak)

        return probe_activation_memory(
            self.module.model, peak_of, [((b, *shape), self.text_len) for shape, b in batches], policy
        )

    def _saved_bytes(self, batch: dict) -> int:
        # CPU estimate of activation memory: the storages autograd keeps for the backward pass.
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
            return t

        self.module.model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with _precision_context(self.precision, self.device):
                loss, _ = self.module.compute_loss(batch)
        loss.backward()
        return sum(storages.values())

    def time(
        self, shape: Sequence[int], b: int, warmup: int, repeats: int
    ) -> tuple[float | None, list[float]]:
        try:
            batch = self.batch(shape, b)
            for _ in range(warmup):
                self.step(batch)
            runs = [self.timed_step(batch) for _ in range(repeats)]
            return statistics.median(runs), runs
        except Exception as err:  # noqa: BLE001
            if not _is_oom(err):
                raise
            return None, []
        finally:
            self.module.model.zero_grad(set_to_none=True)
            _release(self.device)


def auto_checkpointing(
    bench: Bench, policy: str, longest, shortest, seq: dict, max_tokens: int, budget: int
) -> tuple[dict, str]:
    """``calibrate --checkpoint-blocks auto``: fit the memory model on the longest and the shortest shape
    (each at ``max_tokens``) and one sample of the shortest, switch the model to ``checkpoint_blocks="auto"``,
    and return the recipe's model args and a line on what was measured."""
    batches = [
        (longest, max(1, max_tokens // seq[longest])),
        (shortest, max(2, max_tokens // seq[shortest])),
        (shortest, 1),
    ]
    memory, points = bench.activation_memory(policy, batches)
    bench.module.model.set_activation_checkpointing(True, policy, "auto", memory=memory, budget_bytes=budget)
    args = {
        "checkpoint_policy": policy,
        "checkpoint_blocks": "auto",
        "activation_memory": memory.to_dict(),
        "memory_budget_gib": round(budget / _GIB, 3),
    }
    note = "fitted on " + ", ".join(
        f"B{p.batch}xS{p.seq} k={p.checkpointed}: {_size(p.peak_bytes)}" for p in points
    )
    return args, note


def _size(n: float) -> str:
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB"

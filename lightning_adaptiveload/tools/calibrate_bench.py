"""The measurement bench of ``calibrate``: the training model and its optimizer on one device.

Owns how one forward + backward is run at the training precision, how its peak memory is measured (the CUDA
allocator's peak, or on CPU an estimate from the tensors autograd saves) and how it is timed, with
out-of-memory reported as "does not fit" rather than raised. :mod:`lightning_adaptiveload.tools.calibrate`
drives it.

Two benches: :class:`Bench` runs ``VideoDiTModule.compute_loss`` on its preset's model; :class:`ModuleBench`
runs any LightningModule's own ``training_step`` on the DataModule's batch dicts (bucketed from
:func:`~lightning_adaptiveload.loading.collate.collate`, packs from
:func:`~lightning_adaptiveload.loading.packed_collate.collate_packed`), outside a Trainer: the module's
``self.trainer`` is a :class:`StandaloneTrainer` (one process), and ``self.log`` does nothing. Lightning
itself is not imported here.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch

__all__ = [
    "Bench",
    "CannotCalibrate",
    "ModuleBench",
    "StandaloneTrainer",
    "auto_checkpointing",
    "physical_memory",
    "prepare_module",
]

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
        model = self.net = module.model  # the network whose parameters train
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
            self.net.zero_grad(set_to_none=True)
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
        """One forward + backward of ``batch`` (no optimizer step)."""
        self.net.zero_grad(set_to_none=True)
        with _precision_context(self.precision, self.device):
            loss = self.loss(batch)
        loss.backward()

    def loss(self, batch: dict) -> torch.Tensor:
        """The training loss of ``batch``: ``VideoDiTModule.compute_loss``."""
        return self.module.compute_loss(batch)[0]

    def allocate_optimizer_state(self, shape: Sequence[int]) -> None:
        self.step(self.batch(shape, 1))
        self.optimizer.step()
        self.net.zero_grad(set_to_none=True)

    def peak_bytes(self, shape: Sequence[int], b: int) -> int | None:
        """Peak memory of one forward + backward at (shape, b), or None on out-of-memory."""
        try:
            batch = self.batch(shape, b)
            if self.device.type == "cuda":
                self.net.zero_grad(set_to_none=True)
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
            self.net.zero_grad(set_to_none=True)
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

        self.net.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with _precision_context(self.precision, self.device):
                loss = self.loss(batch)
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
            self.net.zero_grad(set_to_none=True)
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


# --------------------------------------------------------------------------------------------------
# A recipe's own LightningModule
# --------------------------------------------------------------------------------------------------


class CannotCalibrate(ValueError):
    """A module that ``calibrate`` cannot measure; the message names the class and why, and what to do."""


class StandaloneTrainer:
    """What a module's hooks may read of the Trainer while ``calibrate`` times them: one process, one device.

    The counts and positions of a single-device run (world size 1, rank 0, epoch 0, step 0), the
    precision, the optimizers ``configure_optimizers`` returned, and ``estimated_stepping_batches``
    (for schedules sized from it). No logger, no strategy, no loop: any other attribute raises an
    ``AttributeError`` that says so, and the probe step reports it.
    """

    def __init__(self, module: Any, precision: str, estimated_stepping_batches: int = 1000) -> None:
        self.lightning_module = module
        self.precision = precision
        self.estimated_stepping_batches = estimated_stepping_batches
        self.optimizers: list[Any] = []
        self.lr_scheduler_configs: list[Any] = []
        self.world_size = self.num_devices = self.num_nodes = self.accumulate_grad_batches = 1
        self.global_rank = self.local_rank = self.node_rank = 0
        self.current_epoch = self.global_step = 0
        self.max_epochs, self.max_steps = 1, -1
        self.is_global_zero = self.training = True
        self.sanity_checking = self.fast_dev_run = False
        self.logger, self.loggers, self.callbacks, self.datamodule = None, [], [], None

    def __getattr__(self, name: str) -> Any:  # only for the attributes not set above
        raise AttributeError(
            f"trainer.{name} is not available: calibrate runs the module's hooks outside a Trainer (one process, "
            "one device, no logger or strategy)"
        )


def _quiet(*args: Any, **kwargs: Any) -> None:
    return None


def _defined_by_lightning(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is Lightning's own default (not overridden by the module's classes)."""
    owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
    return owner is None or owner.__module__.split(".")[0] in ("lightning", "pytorch_lightning")


def _optimizers_of(value: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in what ``configure_optimizers`` returned (any of Lightning's forms)."""
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, Mapping):
        return _optimizers_of(value.get("optimizer"))
    if isinstance(value, list | tuple):
        return [o for item in value for o in _optimizers_of(item)]
    return []  # None (no optimizer), or a scheduler beside the optimizers


def prepare_module(
    module: Any, device: torch.device, precision: str, name: str
) -> list[torch.optim.Optimizer]:
    """Make ``module`` ready to time: checks, ``configure_model``, the device and precision, the trainer view,
    ``configure_optimizers``. Returns its optimizers.

    Raises:
        CannotCalibrate: no ``training_step`` of its own, manual optimization, a hook that fails, parameters
            left on the meta device; the message names ``name`` and why.
    """
    if not callable(getattr(module, "training_step", None)) or _defined_by_lightning(
        type(module), "training_step"
    ):
        raise CannotCalibrate(
            f"calibrate: cannot measure {name}: it defines no training_step (calibrate times the module's own "
            "training_step + backward on the DataModule's batches); define one, as docs/your_own_model.md shows"
        )
    if getattr(module, "automatic_optimization", True) is False:
        raise CannotCalibrate(
            f"calibrate: cannot measure {name}: it uses manual optimization (automatic_optimization = False), so "
            "its training_step runs its own backward and optimizer steps through the Trainer; calibrate times "
            "forward + backward of a training_step that returns its loss"
        )
    configure = getattr(module, "configure_model", None)
    try:
        if callable(configure):
            configure()  # outside a Trainer (self._trainer is None), as in a notebook
    except Exception as err:
        raise CannotCalibrate(
            f"calibrate: cannot measure {name}: its configure_model failed ({_what(err)})"
        ) from err
    params = list(module.parameters())
    if not params:
        raise CannotCalibrate(f"calibrate: cannot measure {name}: it has no parameters after configure_model")
    if any(p.is_meta for p in params):
        raise CannotCalibrate(
            f"calibrate: cannot measure {name}: its parameters are on the meta device after configure_model "
            "(built for a sharding strategy to materialise); build them on a real device outside a Trainer"
        )
    if precision == "bf16-true":
        module.to(torch.bfloat16)
    module.to(device)
    module.train()
    view = StandaloneTrainer(module, precision)
    for sub in module.modules():
        if hasattr(sub, "_trainer"):  # the LightningModule, and any nested one
            sub._trainer = view
            sub.log = sub.log_dict = sub.print = _quiet
    try:
        optimizers = _optimizers_of(module.configure_optimizers())
    except Exception as err:
        raise CannotCalibrate(
            f"calibrate: cannot measure {name}: its configure_optimizers failed ({_what(err)}); the optimizer's "
            "state is part of the memory calibrate measures"
        ) from err
    view.optimizers = optimizers
    return optimizers


def _what(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def _move(value: Any, device: torch.device, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.to(device)
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _move(v, device, dtype) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_move(v, device, dtype) for v in value)
    return value


class ModuleBench(Bench):
    """Any LightningModule on one device: its own ``training_step`` + backward on the DataModule's batch dicts.

    Args:
        module: the LightningModule, after :func:`prepare_module`.
        device, precision, ddp, seed: as for :class:`Bench`.
        batches: a :class:`~lightning_adaptiveload.tools.calibrate_settings.ModuleBatches` (patch size, text,
            dtype).
        text_len: text states per sample (0: no text).
        optimizers: from :func:`prepare_module`; their state is allocated by :meth:`allocate_optimizer_state`
            and counted in the CPU memory estimate.
        name: the module's class path, for the messages.
    """

    def __init__(
        self,
        module: Any,
        device: torch.device,
        precision: str,
        ddp: bool,
        seed: int,
        batches: Any,
        text_len: int,
        optimizers: Sequence[torch.optim.Optimizer],
        name: str,
    ) -> None:
        self.module = self.net = module
        self.device, self.precision, self.name = device, precision, name
        self.batches = batches
        self.text_len = text_len if batches.text_dim is not None else 0
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        self.optimizers = list(optimizers)
        self.optimizer = self.optimizers[0] if self.optimizers else None
        params = list(module.parameters())
        self.param_bytes = sum(p.numel() * p.element_size() for p in params)
        self.num_params = sum(p.numel() for p in params)
        grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        # Parameters and gradients; the optimizers' state is added once one step has allocated it.
        self.static_bytes = self.param_bytes + grad_bytes
        self.ddp_bytes = grad_bytes if ddp else 0  # DDP's buckets, one more copy of the gradients
        self._pack = None
        self._batch_idx = 0
        self.last_loss: torch.Tensor | None = None
        self._dtype = getattr(torch, batches.dtype)
        self._input_dtype = torch.bfloat16 if precision == "bf16-true" else None

    def _samples(self, shapes: Sequence[Sequence[int]]) -> list[dict]:
        text_dim = self.batches.text_dim
        out = []
        for i, shape in enumerate(shapes):
            latent = torch.randn(tuple(int(d) for d in shape), generator=self.gen).to(self._dtype)
            text = None
            if self.text_len > 0:
                text = torch.randn(self.text_len, text_dim, generator=self.gen).to(self._dtype)
            out.append({"__key__": f"calibrate/{i:06d}", "latent": latent, "text": text, "meta": None})
        return out

    def _to_device(self, batch: dict) -> dict:
        """As Lightning moves a batch: the module's transfer hooks where it has them, then the precision's inputs."""
        hooks = [
            getattr(self.module, h, None) for h in ("on_before_batch_transfer", "transfer_batch_to_device")
        ]
        if all(callable(h) for h in hooks) and callable(
            getattr(self.module, "on_after_batch_transfer", None)
        ):
            batch = self.module.on_before_batch_transfer(batch, 0)
            batch = self.module.transfer_batch_to_device(batch, self.device, 0)
            batch = self.module.on_after_batch_transfer(batch, 0)
        return _move(batch, self.device, self._input_dtype)

    def batch(self, shape: Sequence[int], b: int) -> dict:
        """A bucketed batch of ``b`` samples of ``shape``, as ``collate`` gives it (one rank: ``global_tokens``
        is this batch's tokens)."""
        from lightning_adaptiveload.loading.collate import collate

        out = collate(self._samples([shape] * b), self.batches.patch_size, text_pad_to=self._pad_to())
        out["global_tokens"] = out["num_tokens"]
        return self._to_device(out)

    def pack_batch(self, shapes: Sequence[Sequence[int]]) -> dict:
        """A pack of one sample per latent shape, as ``collate_packed`` gives it."""
        from lightning_adaptiveload.loading.packed_collate import collate_packed

        out = collate_packed(self._samples(shapes), self.batches.patch_size, text_pad_to=self._pad_to())
        out["global_tokens"] = out["num_tokens"]
        return self._to_device(out)

    def _pad_to(self) -> int | None:
        pad = self.batches.text_pad_to
        return None if pad is None or self.text_len == 0 else max(int(pad), self.text_len)

    def loss(self, batch: dict) -> torch.Tensor:
        """The loss the module's ``training_step`` returns (a tensor, or a dict's ``"loss"``)."""
        out = self.module.training_step(batch, self._batch_idx)
        self._batch_idx += 1
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = "None" if loss is None else type(loss).__name__
            if isinstance(loss, torch.Tensor):
                got = f"a tensor of shape {list(loss.shape)}"
            raise CannotCalibrate(
                f"calibrate: cannot measure {self.name}: its training_step returned {got}, not a scalar loss "
                "tensor (or a dict with one under 'loss'); calibrate back-propagates the loss it returns"
            )
        if not loss.requires_grad:
            raise CannotCalibrate(
                f"calibrate: cannot measure {self.name}: the loss its training_step returned does not require "
                "grad (computed under no_grad, or detached): there is no backward to time"
            )
        self.last_loss = loss.detach()
        return loss

    def probe(self, shape: Sequence[int], pack: Sequence[Sequence[int]] | None = None) -> None:
        """One step of one sample of ``shape`` (and of ``pack`` through the packed contract), checked.

        Raises:
            CannotCalibrate: the step fails, runs out of memory, gives a non-finite loss, or its backward
                reaches no parameter; the message names the module, the batch and the error.
        """
        probes = [(f"one sample of latent shape {list(shape)}", lambda: self.batch(shape, 1))]
        if pack:
            shapes = [list(s) for s in pack]
            probes.append((f"a pack of {len(shapes)} samples {shapes}", lambda: self.pack_batch(pack)))
        for what, make in probes:
            try:
                self.step(make())
            except CannotCalibrate:
                raise
            except Exception as err:
                self.net.zero_grad(set_to_none=True)
                _release(self.device)
                if _is_oom(err):
                    raise CannotCalibrate(
                        f"calibrate: cannot measure {self.name}: {what} does not fit in the memory of {self.device}"
                    ) from err
                hint = ""
                if self.device.type != "cuda" and "cuda" in str(err).lower():
                    hint = "; it seems to need a GPU: calibrate on one (--device cuda)"
                raise CannotCalibrate(
                    f"calibrate: cannot measure {self.name}: its training_step failed on a probe batch ({what}, "
                    f"on {self.device}): {_what(err)}{hint}"
                ) from err
            loss = self.last_loss
            if loss is None or not math.isfinite(float(loss.float())):
                raise CannotCalibrate(
                    f"calibrate: cannot measure {self.name}: its training_step gave a non-finite loss ({loss}) on "
                    f"a probe batch ({what})"
                )
            if not any(p.grad is not None for p in self.net.parameters()):
                raise CannotCalibrate(
                    f"calibrate: cannot measure {self.name}: the backward of its training_step's loss reached no "
                    f"parameter on a probe batch ({what})"
                )
        self.net.zero_grad(set_to_none=True)

    def allocate_optimizer_state(self, shape: Sequence[int]) -> None:
        """One step and one step of every optimizer: their state exists, and is counted in the CPU estimate."""
        self.step(self.batch(shape, 1))
        for optimizer in self.optimizers:
            optimizer.step()
        self.net.zero_grad(set_to_none=True)
        storages: dict[int, int] = {}
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values() if isinstance(state, Mapping) else ():
                    if isinstance(value, torch.Tensor) and value.device.type != "meta":
                        st = value.untyped_storage()
                        storages[st.data_ptr()] = st.nbytes()
        self.static_bytes += sum(storages.values())

    def activation_memory(self, policy: str, batches: Sequence[tuple[Sequence[int], int]]):
        raise CannotCalibrate(
            f"calibrate: checkpoint_blocks='auto' needs VideoDiT's per-block checkpointing; {self.name} has none"
        )

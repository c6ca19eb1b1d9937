"""``VideoDiTModule``: rectified-flow training of :class:`~lightning_adaptiveload.models.VideoDiT`.

Training objective (Wan 2.1 / SD3 rectified flow)::

    t ~ p(t) on [0, 1]              # "uniform" or "sigmoid" (logit-normal), then shifted (below)
    x_t = (1 - t) * x0 + t * noise  # x0 = clean latent, noise ~ N(0, I)
    v   = model(x_t, 1000 * t, text)
    loss = || v - (noise - x0) ||^2

Timestep shift: ``t' = shift * t / (1 + (shift - 1) * t)``. ``shift > 1`` moves samples toward the noisy
end, which large latents need (the same signal-to-noise ratio needs more noise when there are more
tokens); Wan 2.1 samples with shift 5 at 480p / 720p. ``shift = 1`` leaves t unchanged.

Loss weighting for uneven per-rank batches
------------------------------------------
The adaptive data path gives every rank a different batch (different B and S). DDP averages the
gradients of the ranks with equal weight, so a plain per-rank mean would give a token of a small batch
more weight than a token of a large one. The loss here makes **every token of the global batch count the
same**::

    loss_rank = (sum of per-token squared errors on this rank) * world_size / global_tokens

and DDP's average then yields exactly the gradient of the global per-token mean. Tokens, not samples,
because the objective is a per-token MSE (a sample of 30,000 tokens carries 20 times the signal of one of
1,500) and the compute is paid per token; per-sample weighting would let a few long videos be
under-weighted relative to their cost and a batch of images dominate. ``global_tokens`` comes from the
batch (``batch["global_tokens"]``, filled by the data path when it knows the plan) or, when that is -1,
from one tiny all-gather of the per-rank token counts. With gradient accumulation each micro-batch is
normalised by its own global token count and Lightning averages the micro-batches.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import lightning as L
import torch
from torchmetrics import MeanMetric, Metric
from typing_extensions import override

from lightning_adaptiveload import _dist
from lightning_adaptiveload.models.compile_check import CompileSettings
from lightning_adaptiveload.models.config import padded_text_len
from lightning_adaptiveload.models.loss import global_token_count, rank_noise_generator
from lightning_adaptiveload.models.module_settings import (
    MemorySettings,
    OptimizerSettings,
    SamplingSettings,
    module_settings,
)
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig, forward_flops

_log = logging.getLogger(__name__)

__all__ = [
    "CompileSettings",
    "MemorySettings",
    "OptimizerSettings",
    "SamplingSettings",
    "SequenceParallelFSDPStrategy",
    "SequenceParallelStrategy",
    "VideoDiTModule",
    "sample_timesteps",
    "shift_timesteps",
]

# The groups' defaults (frozen, so one instance serves every module).
_DEFAULT_OPTIMIZER = OptimizerSettings()
_DEFAULT_SAMPLING = SamplingSettings()
_DEFAULT_MEMORY = MemorySettings()


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """``shift * t / (1 + (shift - 1) * t)``: maps [0, 1] onto itself, monotone, identity for shift = 1."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def sample_timesteps(
    n: int,
    sampling: str = "uniform",
    shift: float = 1.0,
    sigmoid_scale: float = 1.0,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Draw ``n`` rectified-flow times in [0, 1] (float32, shape (n,)).

    Args:
        sampling: ``"uniform"``: t ~ U(0, 1); ``"sigmoid"``: t = sigmoid(sigmoid_scale * N(0, 1)), the
            logit-normal of SD3, which concentrates on mid-range t.
        shift: timestep shift applied after sampling (see module docstring).
        sigmoid_scale: standard deviation of the logit for ``"sigmoid"``.
        generator: random generator on ``device``.
    """
    if sampling == "uniform":
        u = torch.rand(n, generator=generator, device=device)
    elif sampling == "sigmoid":
        u = torch.sigmoid(sigmoid_scale * torch.randn(n, generator=generator, device=device))
    else:
        raise ValueError(f"timestep_sampling must be 'uniform' or 'sigmoid', got {sampling!r}")
    return shift_timesteps(u, shift)


class VideoDiTModule(L.LightningModule):
    """Rectified-flow training of a Wan 2.1-style video DiT on the adaptive data path's batches.

    The network is built in :meth:`configure_model` (not in ``__init__``) so that strategies that shard or
    initialise on another device, fusion (``FusedNormModulateMixin``) and ``torch.compile`` apply to it.
    Subclasses and mixins override ``configure_model`` and call ``super().configure_model()`` first.

    Args:
        preset: model configuration, ``"tiny"``, ``"wan-1.3b"`` or ``"wan-14b"``.
        model_overrides: fields of :class:`VideoDiTConfig` to replace, e.g. ``{"num_layers": 4}``.
        init_from: a Wan 2.1 transformer checkpoint folder (Wan's or diffusers' layout, see
            :mod:`lightning_adaptiveload.models.pretrained`) whose weights initialise the model. Its
            ``config.json``, where present, gives the architecture (``preset`` is then unused;
            ``model_overrides`` still apply). The path is saved in the hyper-parameters: where the folder
            is absent, restore a checkpoint with ``load_from_checkpoint(ckpt, init_from=None)`` (the
            folder's architecture is saved as ``model_overrides``).
        optimizer: AdamW, warm-up and the weights' dtype (:class:`OptimizerSettings`).
        sampling: the rectified-flow times of training and validation (:class:`SamplingSettings`).
        memory: activation checkpointing and its memory model (:class:`MemorySettings`).
        compile: ``torch.compile`` every block (lazily: the first forward traces, so later
            ``configure_model`` steps such as fusion still apply), with symbolic sizes so that a length mix
            compiles at most two graphs per mode (see :mod:`lightning_adaptiveload.models.acceleration`).
            ``True``: :class:`~lightning_adaptiveload.models.compile_check.CompileSettings`' defaults; a
            ``CompileSettings``: those; ``False``: eager.
        attention_backend: SDPA kernel order, ``"default"`` (PyTorch's choice), ``"auto"`` (FlashAttention-4
            where flash-attn-4 is installed on Hopper/Blackwell, else cuDNN first on Hopper), ``"fa4"``,
            ``"fa3"``, ``"cudnn"``, ``"flash"``, ``"efficient"``, ``"math"``; see
            :mod:`lightning_adaptiveload.models.attention`.

    Raises:
        ValueError: a bad setting (the message names its recipe key) or preset.
        TypeError: an unknown keyword, or a settings group of another type (or with a key it lacks).
    """

    #: Runs packed batches (``compute_loss`` takes a pack): the DataModule may give lockstep epochs a
    #: packed tail (``AdaptiveLoadDataModule(plan=PlanSettings(lockstep_tail="packed"))``).
    runs_packed_batches = True

    def __init__(
        self,
        preset: str = "tiny",
        model_overrides: dict[str, Any] | None = None,
        *,
        init_from: str | None = None,
        optimizer: OptimizerSettings = _DEFAULT_OPTIMIZER,
        sampling: SamplingSettings = _DEFAULT_SAMPLING,
        memory: MemorySettings = _DEFAULT_MEMORY,
        compile: bool | CompileSettings = False,
        attention_backend: str = "default",
    ) -> None:
        super().__init__()
        settings = module_settings({"optimizer": optimizer, "sampling": sampling, "memory": memory})
        if isinstance(compile, Mapping):  # a checkpoint's hyper-parameters keep the plain form
            compile = CompileSettings(**compile)
        if not isinstance(compile, bool | CompileSettings):
            raise TypeError(
                f"model.init_args.compile = {compile!r}: give true, false or CompileSettings fields "
                "({mode: max-autotune-no-cudagraphs, ...})"
            )
        self.optimizer_settings: OptimizerSettings = settings.optimizer
        self.sampling_settings: SamplingSettings = settings.sampling
        self.memory_settings: MemorySettings = settings.memory
        #: How the blocks are compiled; None: eager.
        self.compile_settings: CompileSettings | None = (
            CompileSettings() if compile is True else compile or None
        )
        # Plain values (no classes): the checkpoint loads with torch.load(weights_only=True), and
        # load_from_checkpoint passes them back to this constructor.
        self.save_hyperparameters(
            {
                "preset": preset,
                "model_overrides": model_overrides,
                "init_from": init_from,
                "optimizer": dataclasses.asdict(settings.optimizer),
                "sampling": dataclasses.asdict(settings.sampling),
                "memory": dataclasses.asdict(settings.memory),
                "compile": dataclasses.asdict(self.compile_settings) if self.compile_settings else False,
                "attention_backend": attention_backend,
            }
        )
        self.model_config = VideoDiTConfig.preset(preset, **(model_overrides or {}))
        if init_from is not None:
            from lightning_adaptiveload.models.pretrained import config_from_folder

            if not os.path.exists(init_from):
                raise FileNotFoundError(
                    f"VideoDiTModule: init_from={init_from!r} does not exist; give a Wan 2.1 transformer folder "
                    "(e.g. <Wan2.1-T2V-1.3B-Diffusers>/transformer) or leave init_from unset"
                )

            self.model_config = config_from_folder(init_from, **(model_overrides or {})) or self.model_config
            # Saved with checkpoints: the architecture then restores without the folder (init_from=None).
            self.hparams["model_overrides"] = {
                k: list(v) if isinstance(v, tuple) else v for k, v in vars(self.model_config).items()
            }
        self.model: VideoDiT | None = None
        self._noise_generator: torch.Generator | None = None
        # The epoch's validation loss, weighted by tokens across every batch of every rank: the metric
        # all-reduces the weighted sum and the total weight at compute(), so ranks with uneven batches
        # count per token, not per rank. The default nan_strategy: "disable" ignores the weights
        # (torchmetrics 1.9), so a NaN batch loss is dropped with a warning instead.
        self.val_loss = MeanMetric()

    # -- model -------------------------------------------------------------------------------------

    @override
    def configure_model(self) -> None:
        """Build the network once (Lightning may call this hook for every stage).

        Under Lightning's ``ModelParallelStrategy`` the network is built on the meta device, fused (where
        ``FusedNormModulateMixin`` is used), given its activation checkpointing, then sharded per block with
        FSDP2 (:func:`~lightning_adaptiveload.models.sharding.shard_model`) and materialised by the strategy
        (or loaded from ``init_from``). A strategy that would train without synchronising gradients is
        refused (:func:`~lightning_adaptiveload.models.strategies.check_strategy`).
        """
        super().configure_model()
        _dist.destroy_gloo_group_at_exit()  # each DDP process on CPU: see _dist.destroy_gloo_group_at_exit
        if self.model is not None:
            return
        from lightning_adaptiveload.models.strategies import check_strategy

        strategy = self._trainer.strategy if self._trainer is not None else None
        fsdp2 = check_strategy(strategy, self) == "fsdp2"
        hp, mem = self.hparams, self.memory_settings
        if mem.expandable_segments:  # before the first parameter is allocated
            from lightning_adaptiveload.models.acceleration import use_expandable_segments

            _log.info("CUDA expandable segments: %s", use_expandable_segments())
        with self._init_context():
            self.model = VideoDiT(self.model_config)
        if hp.init_from is not None and not fsdp2:
            from lightning_adaptiveload.models.pretrained import load_pretrained

            load_pretrained(self.model, hp.init_from)
        self.model.set_activation_checkpointing(
            mem.activation_checkpointing,
            mem.checkpoint_policy,
            mem.checkpoint_blocks,
            memory=mem.activation_memory,
            budget_bytes=self._memory_budget_bytes(),
        )
        self.model.set_attention_backend(hp.get("attention_backend", "default"))
        mesh = getattr(strategy, "sequence_mesh", None)
        if mesh is not None and mesh["sequence"].size() > 1:  # Ulysses: see SequenceParallelStrategy
            self.model.set_sequence_group(mesh["sequence"].get_group())
        if self.optimizer_settings.weight_dtype == "bf16":
            self.model.to(torch.bfloat16)
        if self.compile_settings is not None:
            # Per block: a graph per block type instead of one over the whole (shape-varying) model, and
            # the RoPE table cache stays outside the compiled code.
            from lightning_adaptiveload.models.acceleration import compile_blocks

            compile_blocks(self.model, self.model.blocks, **dataclasses.asdict(self.compile_settings))
        if fsdp2:
            from lightning_adaptiveload.models.strategies import shard_module_model

            shard_module_model(self, strategy)

    def _memory_budget_bytes(self) -> float | None:
        """``memory_budget_gib``, or ``AUTO_BUDGET_FRACTION`` (88%) of the CUDA device's memory; None without."""
        gib = self.memory_settings.memory_budget_gib
        if gib is not None:
            return float(gib) * 2**30
        if self.memory_settings.checkpoint_blocks == "auto":
            if not torch.cuda.is_available():
                raise ValueError('VideoDiTModule: checkpoint_blocks="auto" off CUDA needs memory_budget_gib')
            from lightning_adaptiveload.models.memory import AUTO_BUDGET_FRACTION

            return (
                AUTO_BUDGET_FRACTION
                * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            )
        return None

    def _init_context(self):
        # FSDP materialises (and shards) a meta-device model unit by unit with each module's
        # reset_parameters(), which give Wan's init; building it eagerly would need the whole fp32 model in
        # host memory on every rank (57 GB for wan-14b).
        strategy = self._trainer.strategy if self._trainer is not None else None
        if strategy is not None and _dist._names(strategy) & {"FSDPStrategy", "ModelParallelStrategy"}:
            return torch.device("meta")
        return nullcontext()

    def _require_model(self) -> VideoDiT:
        if self.model is None:
            # Outside a Trainer (tests, notebooks) build on first use.
            self.configure_model()
        return self.model

    @override
    def forward(self, x, timestep, context=None, context_mask=None) -> torch.Tensor:
        """The velocity prediction; see :meth:`VideoDiT.forward` for shapes."""
        return self._require_model()(x, timestep, context, context_mask)

    def flops(self, batch_size: int, seq_len: int, text_len: int = 0) -> int:
        """Analytic forward FLOPs of a batch (see :meth:`VideoDiT.flops_per_sample`); x3 for a training step."""
        return int(batch_size) * forward_flops(self.model_config, seq_len, padded_text_len(self.model_config, text_len))

    def flops_per_batch(self, batch: dict) -> float:
        """Training FLOPs (forward + backward = 3x forward) of ``batch`` on this rank, for MFU.

        Used by :class:`~lightning_adaptiveload.LoadBalanceMonitor`; counts the padded text length. Under
        sequence parallelism, the FLOPs of the group's whole batch (each of its G ranks does 1/G of them):
        the monitor counts every group once (``step_table``'s ``sequence_degree``).
        """
        text = batch.get("text")
        text_len = 0 if text is None else int(text.shape[1])
        if batch.get("packed"):  # attention is per sample: the pack's FLOPs are the samples' sum
            return 3.0 * sum(self.flops(1, int(s), text_len) for s in batch["seq_lens"])
        b, c, t, h, w = batch["latents"].shape
        pt, ph, pw = self.model_config.patch_size
        return 3.0 * self.flops(b, (t // pt) * (h // ph) * (w // pw), text_len)

    # -- loss --------------------------------------------------------------------------------------

    def _sequence_degree(self) -> int:
        """G, the ranks of a sequence group (1 without sequence parallelism)."""
        group = getattr(self.model, "sequence_group", None)
        return 1 if group is None else torch.distributed.get_world_size(group)

    def _world_size(self) -> int:
        """The data-parallel ranks: every rank, or under sequence parallelism the sequence groups."""
        world = int(self.trainer.world_size) if self._trainer is not None else _dist.rank_and_world()[1]
        return world // self._sequence_degree()

    def _global_tokens(self, batch: dict, local_tokens: int, world_size: int) -> int:
        given, degree = batch.get("global_tokens", -1), self._sequence_degree()
        if degree > 1 and int(given) < 0:  # the fallback gathers every rank: each group counted G times
            return global_token_count(local_tokens, -1, world_size * degree) // degree
        return global_token_count(local_tokens, given, world_size)

    def _noise_gen(self, device: torch.device) -> torch.Generator:
        if self._noise_generator is None or self._noise_generator.device != device:
            # Lightning seeds every rank identically; the generator is offset by rank.
            rank, world = _dist.rank_and_world(self._trainer)
            # The ranks of a sequence group (consecutive: the mesh's data dimension is outer) share a batch
            # and so its noise: offset by the data-parallel rank.
            self._noise_generator = rank_noise_generator(device, rank // self._sequence_degree())
            saved = getattr(self, "_saved_noise_states", None)
            if saved is not None and len(saved) == world and saved[rank] is not None:
                # Resumed on the same ranks: draw the noise the uninterrupted run would have drawn.
                self._noise_generator.set_state(saved[rank])
            self._saved_noise_states = None
        return self._noise_generator

    @override
    def on_validation_epoch_start(self) -> None:
        """Make the metric states ordinary tensors again where an earlier ``trainer.validate`` (run under
        inference mode) left inference tensors: a later ``fit`` validates without inference mode, where the
        metric's in-place update of such a tensor raises."""
        with torch.inference_mode(False):
            for metric in self.modules():
                if isinstance(metric, Metric):
                    for name in metric._defaults:
                        value = getattr(metric, name)
                        if isinstance(value, torch.Tensor) and value.is_inference():
                            setattr(metric, name, value.clone())

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Save every rank's noise/timestep generator state (one small gather: Lightning calls this on every
        rank, and rank 0 writes the checkpoint), so that a resumed run continues with the same losses."""
        gen = self._noise_generator
        checkpoint["noise_generator_states"] = _dist.all_gather_object(
            gen.get_state() if gen is not None else None
        )

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Applied when the generator is next made (on the batch's device); ignored for another world size.
        self._saved_noise_states = checkpoint.get("noise_generator_states")
        self._noise_generator = None

    def compute_loss(
        self, batch: dict, noise: torch.Tensor | None = None, t: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-weighted rectified-flow loss of one batch.

        Args:
            batch: the data path's batch dict: ``latents`` (B, C, T, H, W), ``text`` (B, L, D) or None,
                ``text_mask`` (B, L) or None, optionally ``num_tokens`` and ``global_tokens``.
            noise: (B, C, T, H, W) noise to use instead of a fresh draw (tests, validation).
            t: (B,) times in [0, 1] to use instead of sampling.

        Returns:
            ``(loss, mse)``: ``loss`` is the scalar to back-propagate (this rank's share of the global
            per-token mean, see the module docstring); ``mse`` is this rank's per-token mean squared error,
            detached, for logging.
        """
        if batch.get("packed"):  # the packed contract: a list of latents of any shapes
            return self._compute_loss_packed(batch, noise, t)
        x0 = batch["latents"].float()
        b = x0.shape[0]
        cfg = self.model_config
        elems_per_token = cfg.in_channels * cfg.patch_volume
        if x0.dim() != 5 or x0.shape[1] != cfg.in_channels:
            # Checked before the token count, which a channel mismatch also breaks (and would be blamed).
            raise ValueError(
                f"batch['latents'] has shape {tuple(x0.shape)}: {x0.shape[1] if x0.dim() > 1 else '?'} channels, "
                f"but the model takes (B, {cfg.in_channels}, T, H, W) latents (another VAE's latents?): set "
                "model_overrides={'in_channels': C} to the latents' channel count, or use this model's VAE"
            )
        local_tokens = x0.numel() // elems_per_token
        reported = batch.get("num_tokens")
        if reported is not None and int(reported) != local_tokens:
            raise ValueError(
                f"batch['num_tokens'] = {int(reported)} but latents {tuple(x0.shape)} make {local_tokens} tokens "
                f"with the model's patch_size {cfg.patch_size}; give the data module the model's patch_size"
            )
        if t is None:
            t = sample_timesteps(
                b,
                self.sampling_settings.timestep_sampling,
                self.sampling_settings.shift,
                self.sampling_settings.sigmoid_scale,
                generator=self._noise_gen(x0.device),
                device=x0.device,
            )
        if noise is None:
            noise = torch.randn(x0.shape, generator=self._noise_gen(x0.device), device=x0.device)
        token_sq_err_sum = self._sample_errors(batch, x0, noise, t).sum()
        world = self._world_size()
        global_tokens = self._global_tokens(batch, local_tokens, world)
        # max(.., 1): a step at which every rank's batch is empty contributes nothing.
        loss = token_sq_err_sum * (world / max(global_tokens, 1))
        # max(.., 1): a batch whose samples were all skipped at read time has no tokens (and adds nothing).
        return loss, (token_sq_err_sum / max(local_tokens, 1)).detach()

    def _sample_errors(
        self, batch: dict, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor
    ) -> torch.Tensor:
        """(B,) fp32: each sample's squared velocity error summed over its tokens (over its elements, divided
        by the elements per token). x0, noise (B, C, T, H, W) fp32; t (B,) in [0, 1]."""
        b = x0.shape[0]
        t = t.to(device=x0.device, dtype=torch.float32)
        tb = t.view(b, 1, 1, 1, 1)
        x_t = (1.0 - tb) * x0 + tb * noise
        pred = self._require_model()(
            x_t, t * self.sampling_settings.num_train_timesteps, batch.get("text"), batch.get("text_mask")
        )
        elems_per_token = self.model_config.in_channels * self.model_config.patch_volume
        return (pred.float() - (noise - x0)).square().flatten(1).sum(1) / elems_per_token

    def _compute_loss_packed(
        self, batch: dict, noise: list[torch.Tensor] | None, t: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`compute_loss` for a pack (``docs/data_path.md``, "Packed batches"): one timestep and one
        noise draw per sample, the same token-weighted loss as the samples in separate batches."""
        from lightning_adaptiveload.models.packing import flow_loss_packed

        latents = batch["latents"]
        device = latents[0].device
        n = len(latents)
        if t is None:
            t = sample_timesteps(
                n,
                self.sampling_settings.timestep_sampling,
                self.sampling_settings.shift,
                self.sampling_settings.sigmoid_scale,
                generator=self._noise_gen(device),
                device=device,
            )
        if noise is None:
            noise = [torch.randn(x.shape, generator=self._noise_gen(device), device=device) for x in latents]
        err, local_tokens = flow_loss_packed(
            self._require_model(),
            latents,
            t.to(device=device, dtype=torch.float32),
            noise,
            self.sampling_settings.num_train_timesteps,
            batch.get("text"),
            batch.get("text_mask"),
        )
        world = self._world_size()
        global_tokens = self._global_tokens(batch, local_tokens, world)
        return err * (world / max(global_tokens, 1)), (err / max(local_tokens, 1)).detach()

    # -- Lightning hooks ---------------------------------------------------------------------------

    @override
    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss, mse = self.compute_loss(batch)
        b = max(1, len(batch["latents"]))  # a tensor (bucketed) or a list (packed)
        self.log("train/loss", mse, on_step=True, on_epoch=False, prog_bar=True, batch_size=b)
        self.log("train/lr", self._current_lr(), on_step=True, on_epoch=False, batch_size=b)
        return loss

    @override
    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        # An empty step (a rank with no validation sample left) runs its zero samples through the model
        # too: under FSDP every forward gathers parameters with all ranks. Its weight is 0.
        mse, tokens = self._fixed_time_mse(batch, batch_idx)
        return self._log_val_loss(mse, tokens)

    def _log_val_loss(self, mse: torch.Tensor, tokens: int) -> torch.Tensor:
        # Not self.log(mse, sync_dist=True): that averages the ranks' means with equal weight.
        self.val_loss.update(mse.detach().float(), weight=float(tokens))
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        return mse

    def _fixed_time_mse(self, batch: dict, batch_idx: int) -> tuple[torch.Tensor, int]:
        """Per-token MSE of ``batch`` averaged over ``val_timesteps`` with fixed noise (per batch and time, so
        that validation losses are comparable across epochs), and its tokens. 0 for an empty batch."""
        x0 = batch["latents"]
        tokens = int(x0.numel() // (self.model_config.in_channels * self.model_config.patch_volume))
        local = {**batch, "global_tokens": tokens}  # this rank's mean only: no collective
        gen = torch.Generator(device=x0.device)
        losses = []
        for i, tv in enumerate(self.sampling_settings.val_timesteps):
            gen.manual_seed(1_000_003 * batch_idx + i)
            noise = torch.randn(x0.shape, generator=gen, device=x0.device)
            t = torch.full((x0.shape[0],), float(tv), device=x0.device)
            losses.append(self.compute_loss(local, noise=noise, t=t)[1])
        return torch.stack(losses).mean(), tokens

    @override
    def test_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """``test/loss``: the validation measure (fixed times and noise) on the test data."""
        mse, tokens = self._fixed_time_mse(batch, batch_idx)
        self.log("test/loss", mse, on_epoch=True, sync_dist=True, batch_size=max(tokens, 1))
        return mse

    @override
    def predict_step(self, batch: dict, batch_idx: int) -> dict[str, Any]:
        """Per-sample loss at the validation times: ``{"keys": [...], "loss": Tensor (B,)}``.

        A trained DiT is sampled by a diffusion sampler, not by one forward pass; prediction here scores
        the samples (e.g. to find the hardest clips), with the fixed noise of validation: every sample gets
        the noise it would get in a batch of its own. One forward per time for the whole batch, so that every
        rank runs as many forwards as the others whatever its batch size (FSDP gathers in each).
        """
        x0 = batch["latents"].float()
        b = x0.shape[0]
        tokens_per_sample = max(1, math.prod(x0.shape[2:]) // self.model_config.patch_volume)
        gen = torch.Generator(device=x0.device)
        losses = torch.zeros(b, device=x0.device)
        for i, tv in enumerate(self.sampling_settings.val_timesteps):
            gen.manual_seed(1_000_003 * batch_idx + i)
            noise = torch.randn((1, *x0.shape[1:]), generator=gen, device=x0.device).expand_as(x0)
            t = torch.full((b,), float(tv), device=x0.device)
            losses += self._sample_errors(batch, x0, noise, t) / tokens_per_sample
        loss = losses / len(self.sampling_settings.val_timesteps)
        return {"keys": list(batch.get("keys", [])), "loss": loss.detach().cpu()}

    def _current_lr(self) -> float:
        if self._trainer is None or not self.trainer.optimizers:
            return float(self.optimizer_settings.lr)
        return float(self.trainer.optimizers[0].param_groups[0]["lr"])

    @override
    def configure_optimizers(self) -> dict:
        model = self._require_model()
        decay, no_decay = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            # Matrices decay; biases, norm weights and the modulation tables (offsets) do not.
            (decay if p.dim() >= 2 and not name.endswith("modulation") else no_decay).append(p)
        opt = self.optimizer_settings
        groups = [
            {"params": decay, "weight_decay": opt.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer_cls = torch.optim.AdamW
        if opt.weight_dtype == "bf16":
            from lightning_adaptiveload.models.master_weights import MasterWeightAdamW

            optimizer_cls = MasterWeightAdamW
        optimizer = optimizer_cls(
            [g for g in groups if g["params"]],
            lr=opt.lr,
            betas=opt.betas,
            eps=opt.eps,
        )
        warmup = opt.warmup_steps

        def factor(step: int) -> float:
            return 1.0 if warmup == 0 else min(1.0, (step + 1) / warmup)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def extra_repr(self) -> str:
        n = sum(p.numel() for p in self.model.parameters()) if self.model is not None else 0
        return (
            f"preset={self.hparams.preset!r}, params={n / 1e6:.1f}M"
            if n
            else f"preset={self.hparams.preset!r}"
        )


# --------------------------------------------------------------------------------------------------
# Sequence parallelism: the strategies a recipe names (docs/sequence_parallel.md)
# --------------------------------------------------------------------------------------------------


class _SequenceMesh:
    """The ("data", "sequence") device mesh of a strategy: ``sequence_parallel_size`` consecutive ranks form a
    sequence group (ranks 0..G-1 the first), and the data dimension runs across the groups.

    Gradients: every rank of a group holds the same parameters, and the model's backward leaves on each the
    gradient whose average over the group is the group's full-batch gradient
    (:func:`~lightning_adaptiveload.models.sequence_parallel.gather_sequence`). So data parallelism over
    **every** rank (DDP's default group; FSDP2 on a 1-D mesh of the world) averages to exactly what DDP over
    the data groups alone gives, with no second reduction."""

    def _init_sequence(self, sequence_parallel_size: int) -> None:
        if isinstance(sequence_parallel_size, bool) or not (
            isinstance(sequence_parallel_size, int) and sequence_parallel_size >= 1
        ):
            raise ValueError(
                f"{type(self).__name__}: sequence_parallel_size must be an integer >= 1, got "
                f"{sequence_parallel_size!r}"
            )
        self.sequence_parallel_size = sequence_parallel_size
        #: The ("data", "sequence") DeviceMesh, built after the process group (None before).
        self.sequence_mesh: Any = None

    def _build_sequence_mesh(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        world, g = int(self.world_size), self.sequence_parallel_size
        if world % g:
            raise ValueError(
                f"{type(self).__name__}: sequence_parallel_size={g} does not divide the {world} processes; "
                "give a degree that divides devices x num_nodes"
            )
        self.sequence_mesh = init_device_mesh(
            self.root_device.type, (world // g, g), mesh_dim_names=("data", "sequence")
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica per data-parallel group: every rank of a sequence group reads the same samples."""
        g = self.sequence_parallel_size
        return {"num_replicas": int(self.world_size) // g, "rank": int(self.global_rank) // g}


class SequenceParallelStrategy(_SequenceMesh, L.pytorch.strategies.DDPStrategy):
    """DDP with Ulysses sequence parallelism: groups of ``sequence_parallel_size`` ranks split each batch's
    sequence (:meth:`VideoDiT.set_sequence_group`, set by :class:`VideoDiTModule` in ``configure_model``);
    DDP runs over every rank (see :class:`_SequenceMesh` for why that is exact).

    Args:
        sequence_parallel_size: G, the ranks of a sequence group; divides the world size and the heads.
        process_group_backend: ``"nccl"``, ``"gloo"``, or None for the device's default.
        timeout: of the process group's collectives; None: torch's default.
        ddp_kwargs: any further :class:`~lightning.pytorch.strategies.DDPStrategy` arguments
            (``find_unused_parameters``, ``static_graph``, ...).

    Example (a recipe)::

        trainer:
          strategy:
            class_path: lightning_adaptiveload.models.module.SequenceParallelStrategy
            init_args: {sequence_parallel_size: 4}
    """

    def __init__(
        self,
        sequence_parallel_size: int = 2,
        process_group_backend: str | None = None,
        timeout: Any = None,
        ddp_kwargs: dict[str, Any] | None = None,
    ) -> None:
        extra = {} if timeout is None else {"timeout": timeout}
        super().__init__(process_group_backend=process_group_backend, **extra, **(ddp_kwargs or {}))
        self._init_sequence(sequence_parallel_size)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._build_sequence_mesh()


class SequenceParallelFSDPStrategy(_SequenceMesh, L.pytorch.strategies.ModelParallelStrategy):
    """FSDP2 with Ulysses sequence parallelism: :class:`SequenceParallelStrategy`'s sequence groups, the model
    sharded by FSDP2 over every rank (a 1-D mesh of the world; the module shards itself in
    ``configure_model``, as under ``ModelParallelStrategy``).

    Args:
        sequence_parallel_size: G, the ranks of a sequence group.
        save_distributed_checkpoint: one file per rank (True) or a full checkpoint gathered on rank 0.
        process_group_backend: ``"nccl"``, ``"gloo"``, or None for the device's default.
        timeout: of the process group's collectives; None: torch's default.
    """

    def __init__(
        self,
        sequence_parallel_size: int = 2,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: Any = None,
    ) -> None:
        extra = {} if timeout is None else {"timeout": timeout}
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            **extra,
        )
        self._init_sequence(sequence_parallel_size)

    @override
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup_environment()  # the process group, and Lightning's own (data, tensor) mesh
        self._build_sequence_mesh()
        # FSDP2 over every rank: the mesh the module's configure_model shards on (module.device_mesh).
        self._device_mesh = init_device_mesh(self.root_device.type, (int(self.world_size),))
        self.lightning_module._device_mesh = self._device_mesh

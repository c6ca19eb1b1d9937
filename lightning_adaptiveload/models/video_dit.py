"""A video diffusion transformer with Wan 2.1's architecture, written to be read top to bottom.

The model maps a noisy VAE latent ``x_t`` (B, C, T, H, W), a diffusion time (B,) and optional text states
(B, L, D_text) to a velocity of the latent's shape. Its parts, in the order data flows through them:

1. **Patch embedding**: a Conv3d with kernel = stride = ``patch_size`` (1, 2, 2) turns the latent into
   S = T/pt * H/ph * W/pw tokens of width D.
2. **Time embedding**: sinusoidal features of t (``freq_dim`` wide) -> Linear-SiLU-Linear -> e (B, D), then
   SiLU-Linear -> e0 (B, 6, D): shift, scale and gate for self-attention and for the FFN. Both are kept in
   fp32, as Wan does, because they scale every activation of every block.
3. **Text embedding**: Linear-GELU(tanh)-Linear from ``text_dim`` to D.
4. **Blocks** (``num_layers`` of them), each with its own learned (1, 6, D) table added to e0 (Wan's
   ``modulation``, a.k.a. scale_shift_table)::

       x = x + gate_sa  * SelfAttn(NormModulate(x, shift_sa, scale_sa))      # 3D RoPE, q/k RMSNorm
       x = x + CrossAttn(LayerNorm_affine(x), text, text_mask)               # no modulation
       x = x + gate_ffn * FFN(NormModulate(x, shift_ffn, scale_ffn))         # GELU(tanh)

   The residual stream is kept in fp32 (the gated adds run in fp32 as in Wan); matmuls follow autocast.
5. **Head**: NormModulate with its own (1, 2, D) table added to e (not e0), then a Linear to
   C_out * pt * ph * pw, zero-initialised so that the untrained model predicts 0.
6. **Unpatchify** back to (B, C_out, T, H, W).

Every LayerNorm-then-modulate site is a :class:`NormModulate`, whose ``fused`` switch routes it through
:func:`lightning_adaptiveload.ops.layer_norm_modulate` (the fused kernel) instead of the eager form; the
switch does not change parameters or state_dict keys. Module and parameter names follow Wan 2.1's
reference implementation (``patch_embedding``, ``blocks.N.self_attn.q``, ``blocks.N.modulation``,
``head.head``, ...), so a Wan 2.1 checkpoint's state_dict has the same keys and shapes.

The leaf layers (norms, embeddings, Wan's 3-D RoPE, the two attention layers, the head) are in
:mod:`~lightning_adaptiveload.models.layers`.

``forward`` also takes a *pack*: a list of N latents of any shapes, run as one step in which each sample
attends only to itself (:mod:`~lightning_adaptiveload.models.packing`). Equal token counts run as a batch;
mixed ones as one token sequence whose blocks, attention layers and head get ``segments=`` (a
:class:`~lightning_adaptiveload.models.packing.PackSegments`). Either way every block runs through its own
``__call__``, so FSDP's hooks and compiled blocks see packs.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.models import attention as _attention
from lightning_adaptiveload.models import packing as _packing
from lightning_adaptiveload.models import sequence_parallel as _sp
from lightning_adaptiveload.models.checkpointing import (  # noqa: F401  (re-exported; _spread is the old private name)
    CHECKPOINT_POLICIES,
    apply_checkpointing,
    auto_count,
    run_block,
    save_attention_contexts,
)
from lightning_adaptiveload.models.checkpointing import spread as _spread  # noqa: F401
from lightning_adaptiveload.models.config import VideoDiTConfig, forward_flops, padded_text_len
from lightning_adaptiveload.models.layers import (
    CrossAttention,
    FP32LayerNorm,
    Head,
    Linear,
    MatmulBiasLinear,
    NormModulate,
    PatchEmbed,
    SelfAttention,
    rope_3d,
    sinusoidal_embedding,
)

__all__ = ["CHECKPOINT_POLICIES", "NormModulate", "VideoDiT", "VideoDiTConfig", "forward_flops"]


class DiTBlock(nn.Module):
    """One Wan 2.1 block: modulated self-attention, cross-attention, modulated FFN, gated residuals."""

    def __init__(self, cfg: VideoDiTConfig) -> None:
        super().__init__()
        dim = cfg.dim
        self.norm1 = NormModulate(dim, cfg.eps)
        self.self_attn = SelfAttention(dim, cfg.num_heads, cfg.qk_norm, cfg.eps)
        self.norm3 = (
            FP32LayerNorm(dim, cfg.eps, elementwise_affine=True) if cfg.cross_attn_norm else nn.Identity()
        )
        self.cross_attn = CrossAttention(dim, cfg.num_heads, cfg.qk_norm, cfg.eps)
        self.norm2 = NormModulate(dim, cfg.eps)
        # norm3 and norm2 feed one matmul each (cross-attention's q, the FFN); norm1 feeds three (q, k, v),
        # whose gradients are best added up at the residual stream's width, so it keeps x's dtype.
        self.norm3.feeds_matmul = self.norm2.feeds_matmul = True
        self.ffn = nn.Sequential(
            # The first projection's bias gradient is a matmul under compile (see MatmulBiasLinear).
            MatmulBiasLinear(dim, cfg.ffn_dim),
            nn.GELU(approximate="tanh"),
            Linear(cfg.ffn_dim, dim),
        )
        # Per-block table added to the shared timestep projection (Wan's scale_shift_table).
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        # None, or one of CHECKPOINT_POLICIES; set by VideoDiT.set_activation_checkpointing. Applied inside
        # forward so that a compiled block (torch.compile over forward) includes its checkpoint.
        self.checkpoint_policy: str | None = None

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.modulation.normal_(std=self.modulation.shape[-1] ** -0.5)

    def forward(
        self,
        x: torch.Tensor,
        e0: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
        segments: _packing.PackSegments | None = None,
    ) -> torch.Tensor:
        """Args: x (B, S, D) residual stream; e0 (B, 6, D) fp32, or (B, S, 6, D) with per-token timesteps
        (Wan 2.2); cos, sin (S, d/2), or (B, S, d/2) per sample; context (B, L, D) or None; context_mask
        (B, L) bool or None; segments: None for a batch, or for a pack of mixed lengths its
        :class:`~lightning_adaptiveload.models.packing.PackSegments`, with x (1, S_total, D), e0 (N, 6, D)
        fp32 per sample, cos/sin (S_total, d/2) and context (N, L, D).
        Returns x's shape in x.dtype."""
        args = (x, e0, cos, sin, context, context_mask, segments)
        return run_block(self.checkpoint_policy, self.training, self._forward, *args)

    def _forward(
        self,
        x: torch.Tensor,
        e0: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
        segments: _packing.PackSegments | None = None,
    ) -> torch.Tensor:
        # A sequence shard (Ulysses) runs as a batch of its tokens; only self-attention sees the shard.
        shard, segments = (segments, None) if isinstance(segments, _sp.SequenceShard) else (None, segments)
        mod = self.modulation.float() + e0  # (B, 6, D), or (B, S, 6, D) per token, or (N, 6, D) per sample
        if context is None and self.training and torch.is_grad_enabled():
            # No text: zero gradients for the cross-attention (see VideoDiT._keep_text_path), added here, in
            # the block's own forward, where FSDP has gathered its parameters.
            mod = mod + _zero_sum(self.norm3, self.cross_attn)
        if segments is None:
            # Per sample: six (B, 1, D) tables; per token: six (B, S, D) ones (the fused op's per-token layout).
            tables = mod.unbind(-2) if mod.dim() == 4 else mod.chunk(6, 1)

            def row(i: int) -> torch.Tensor:
                return tables[i]

        else:
            # A mixed pack: each (N, D) row spread to its samples' tokens, (1, S, D), where it is used (six at
            # once would be a (S, 6, D) fp32 table: 4.8 GB at 131,040 tokens of wan-1.3b); the gradient
            # comes back as a sum per sample (packing.segment_rows).
            def row(i: int) -> torch.Tensor:
                return _packing.segment_rows(mod[:, i], segments)

        y = self.self_attn(self.norm1(x, row(0), row(1)), cos, sin, shard or segments)
        x = (x + y * row(2)).to(x.dtype)
        if context is not None:
            x = (x + self.cross_attn(self.norm3(x), context, context_mask, segments)).to(x.dtype)
        y = self.ffn(self.norm2(x, row(3), row(4)))
        return (x + y * row(5)).to(x.dtype)


def _zero_sum(*modules: nn.Module) -> torch.Tensor | float:
    """0 x the sum of the modules' trainable parameters (0-d, so adding it keeps the other operand's dtype):
    an output plus this gives each parameter a zero gradient."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    return 0.0 * sum(p.sum() for p in params) if params else 0.0


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class VideoDiT(nn.Module):
    """Wan 2.1-style video DiT. See the module docstring for the data flow.

    Args:
        config: a :class:`VideoDiTConfig`, e.g. ``VideoDiTConfig.preset("wan-1.3b")``.

    Attributes:
        gradient_checkpointing: recompute blocks in the backward pass (activation checkpointing) while
            training; saves the blocks' activations at the cost of one more forward per block. Setting it
            is ``set_activation_checkpointing(value)``; that method also picks what is kept and how many
            blocks are checkpointed.
    """

    def __init__(self, config: VideoDiTConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.patch_embedding = PatchEmbed(
            cfg.in_channels, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.text_embedding = nn.Sequential(
            Linear(cfg.text_dim, cfg.dim, "normal"),
            nn.GELU(approximate="tanh"),
            Linear(cfg.dim, cfg.dim, "normal"),
        )
        self.time_embedding = nn.Sequential(
            Linear(cfg.freq_dim, cfg.dim, "normal"), nn.SiLU(), Linear(cfg.dim, cfg.dim, "normal")
        )
        self.time_projection = nn.Sequential(nn.SiLU(), Linear(cfg.dim, 6 * cfg.dim))
        self.blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.attention_backend = "default"
        self.cross_attention_splits: int | str = "auto"
        # (device, name, splits) the attention modules were set for
        self._backends_for: tuple[str, str, int | str] | None = None
        # (policy, ActivationMemory, budget bytes) when the checkpointed-block count is chosen per batch.
        self._auto_checkpointing: tuple[str, Any, float] | None = None
        self.last_checkpointed_blocks: int | None = None  # the count the last forward ran with
        self._over_budget: set[tuple[int, int]] = set()  # (B, S) of batches warned about (over budget)
        self._sequence = _sp.GroupRef()  # Ulysses sequence parallelism's group; see set_sequence_group
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Wan 2.1's initialisation: Xavier-uniform Linears and patch embedding, zero biases, N(0, 0.02) for
        the text and time embeddings, a zero output projection (the untrained model predicts 0), modulation
        tables N(0, 1/D). Each module carries its part (``reset_parameters``), so FSDP's per-module
        materialisation from the meta device gives the same initialisation."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()

    # -- helpers -----------------------------------------------------------------------------------

    def _rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # One entry per distinct latent shape; a length mix has a few dozen at most. Tables made under
        # inference_mode (trainer.validate before fit) cannot be saved for backward: kept apart.
        if torch.compiler.is_compiling():
            # Inside a compiled forward (the whole model compiled) the table is part of the graph; a cached
            # tensor made there would be a graph output, which CUDA graphs overwrite at the next replay.
            return rope_3d(grid, self.config.head_dim, self.config.rope_theta, device)
        key = (grid, str(device), torch.is_inference_mode_enabled())
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_3d(grid, self.config.head_dim, self.config.rope_theta, device)
        return self._rope_cache[key]

    def _check_input(self, x: torch.Tensor) -> tuple[int, int, int]:
        cfg = self.config
        if x.dim() != 5 or x.shape[1] != cfg.in_channels:
            raise ValueError(
                f"VideoDiT expects latents of shape (B, {cfg.in_channels}, T, H, W), got {tuple(x.shape)}; "
                "set in_channels in the model config to the latent's channel count"
            )
        t, h, w = x.shape[2:]
        pt, ph, pw = cfg.patch_size
        if t % pt or h % ph or w % pw:
            raise ValueError(
                f"latent (T, H, W) = {(t, h, w)} is not divisible by patch_size {cfg.patch_size}; "
                "crop or pad the latents, or change the patch size"
            )
        return t // pt, h // ph, w // pw

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """(B, F*H'*W', C_out*pt*ph*pw) -> (B, C_out, F*pt, H'*ph, W'*pw); inverse of the patch layout."""
        (f, h, w), (pt, ph, pw) = grid, self.config.patch_size
        b, c = tokens.shape[0], self.config.out_channels
        x = tokens.view(b, f, h, w, pt, ph, pw, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, c, f * pt, h * ph, w * pw)

    @classmethod
    def from_pretrained(cls, path: str, config: VideoDiTConfig | None = None, **overrides: Any) -> VideoDiT:
        """A model built from ``<path>/config.json`` (or ``config``) with the folder's weights: a Wan 2.1
        transformer folder in Wan's or diffusers' layout (:mod:`lightning_adaptiveload.models.pretrained`).

        Args:
            path: the folder.
            config: the configuration to use when the folder has no ``config.json``; with one, its fields
                win unless overridden.
            **overrides: fields of :class:`VideoDiTConfig` to replace (non-architectural ones, such as
                ``eps``; architectural ones make loading fail by name).

        Raises:
            PretrainedError: no config anywhere, or the weights do not fit (see
                :func:`~lightning_adaptiveload.models.pretrained.load_pretrained`).
        """
        from lightning_adaptiveload.models.pretrained import (
            CONFIG_NAME,
            PretrainedError,
            config_from_folder,
            load_pretrained,
        )

        cfg = config_from_folder(path, **overrides)
        if cfg is None:
            if config is None:
                raise PretrainedError(
                    f"{os.fspath(path)} has no {CONFIG_NAME}; pass config=VideoDiTConfig.preset(...) to say "
                    "which architecture the weights are"
                )
            cfg = VideoDiTConfig(**{**config.__dict__, **overrides})
        return load_pretrained(cls(cfg), path)

    @property
    def gradient_checkpointing(self) -> bool:
        return any(block.checkpoint_policy is not None for block in self.blocks)

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled: bool) -> None:
        self.set_activation_checkpointing(bool(enabled))

    def set_activation_checkpointing(
        self,
        enabled: bool = True,
        policy: str = "full",
        num_blocks: int | str | None = None,
        memory: Any = None,
        budget_bytes: float | None = None,
    ) -> None:
        """Choose which blocks recompute their forward in the backward pass, and what they keep.

        Args:
            enabled: False turns checkpointing off everywhere.
            policy: ``"full"`` keeps only each block's inputs (the least memory, one more forward of the
                block); ``"save_attention"`` also keeps the attention kernels' outputs (per block about
                2 bytes x B x S x D more at bf16), so the recompute skips attention, the costliest part;
                ``"save_matmuls"`` keeps every matmul's and attention's output and recomputes only the
                elementwise work (norms, RoPE, GELU, gates): more memory, almost no recompute.
            num_blocks: how many blocks to checkpoint (None: all), spread evenly over the depth; the rest
                keep all their activations. ``"auto"``: per batch, the fewest that keep the step's modelled
                peak within ``budget_bytes`` (``memory.checkpointed_blocks``), so that a long clip
                recomputes fewer blocks than a batch of many images of the same tokens. A compiled block
                then has a graph with and one without its checkpoint. A batch predicted over the budget
                even with every block checkpointed runs with every block checkpointed, with one warning.
            memory: for ``"auto"``: a :class:`lightning_adaptiveload.models.memory.ActivationMemory` (or
                its ``to_dict()`` mapping), e.g. from
                :func:`lightning_adaptiveload.models.acceleration.probe_activation_memory`.
            budget_bytes: for ``"auto"``: the memory one step may use.

        Raises:
            ValueError: unknown policy, num_blocks out of range, or ``"auto"`` without memory and budget.
        """
        if policy not in CHECKPOINT_POLICIES:
            raise ValueError(f"checkpoint policy must be one of {list(CHECKPOINT_POLICIES)}, got {policy!r}")
        n = len(self.blocks)
        self._auto_checkpointing = None
        self.last_checkpointed_blocks = None
        if num_blocks == "auto" and enabled:
            from lightning_adaptiveload.models.memory import ActivationMemory

            if memory is None or budget_bytes is None:
                raise ValueError(
                    'num_blocks="auto" needs memory= (an ActivationMemory, see '
                    "acceleration.probe_activation_memory) and budget_bytes="
                )
            if isinstance(memory, dict):
                memory = ActivationMemory.from_dict(memory)
            if memory.num_blocks != n:
                raise ValueError(f"the memory model is for {memory.num_blocks} blocks, the model has {n}")
            self._auto_checkpointing = (policy, memory, float(budget_bytes))
            num_blocks = None  # every block until the first forward chooses
        count = n if num_blocks is None else int(num_blocks)
        if not 0 <= count <= n:
            raise ValueError(
                f"num_blocks must lie in [0, {n}] (the model has {n} blocks), got {num_blocks!r}"
            )
        apply_checkpointing(self.blocks, policy, count if enabled else 0)

    def _choose_checkpointing(self, batch: int, seq: int, text: int) -> None:
        """``num_blocks="auto"``: set the checkpointed blocks for this batch (a no-op when it is unchanged)."""
        if self._auto_checkpointing is None or not (self.training and torch.is_grad_enabled()):
            return
        policy, memory, budget = self._auto_checkpointing
        count = auto_count(memory, (batch, seq, text), budget, self._over_budget)
        if count != self.last_checkpointed_blocks:
            apply_checkpointing(self.blocks, policy, count)
            self.last_checkpointed_blocks = count

    def set_attention_backend(self, name: str) -> None:
        """Pick the attention kernels (see :mod:`lightning_adaptiveload.models.attention`): ``"default"`` (PyTorch's
        choice; the initial setting), ``"auto"`` (FlashAttention-4 where installed on Hopper/Blackwell, else
        cuDNN on Hopper, FlashAttention before), ``"fa4"``, ``"fa3"``, ``"cudnn"``, ``"flash"``,
        ``"efficient"``, ``"math"``.

        The choice is resolved for the input's device at the next forward; the first forward on a new
        input layout logs the kernel that runs (logger ``lightning_adaptiveload.models.attention``).
        """
        _attention.resolve_attention_backends(name)  # validates the name
        self.attention_backend = name
        self._backends_for = None

    def set_cross_attention_splits(self, splits: int | str = "auto") -> None:
        """How many chunks the cross-attention cuts one long sample's queries into
        (:func:`~lightning_adaptiveload.models.attention.sdpa_split_queries`: the same result, a backward
        that fills the GPU): ``"auto"`` (the initial setting; :func:`~lightning_adaptiveload.models.attention.
        query_splits` for the device, 1 off CUDA) or a count (1: never)."""
        if splits != "auto" and not (
            isinstance(splits, int) and not isinstance(splits, bool) and splits >= 1
        ):
            raise ValueError(f"cross-attention splits must be 'auto' or an integer >= 1, got {splits!r}")
        self.cross_attention_splits = splits
        self._backends_for = None

    def _apply_attention_backend(self, device: torch.device) -> None:
        key = (str(device), self.attention_backend, self.cross_attention_splits)
        if self._backends_for == key:
            return
        backends = _attention.resolve_attention_backends(self.attention_backend, device)
        splits = self.cross_attention_splits
        if splits == "auto":
            splits = _attention.query_splits(device, self.config.num_heads)
        for block in self.blocks:
            block.self_attn.backends = backends
            block.cross_attn.backends = backends
            block.cross_attn.query_splits = splits
        self._backends_for = key

    def set_sequence_group(self, group: Any) -> None:
        """Split every batch's token sequence over ``group`` (Ulysses sequence parallelism,
        :mod:`~lightning_adaptiveload.models.sequence_parallel`); None (the initial setting) turns it off.

        Every rank of the group must be given the same batch (latents, timesteps, text). Each keeps 1/G of the
        patchified tokens (zero padded to a multiple of G) with their own RoPE positions; self-attention
        runs through :func:`~lightning_adaptiveload.models.sequence_parallel.ulysses_attention`, cross-attention,
        modulation and the head on the shard; the output is gathered, so :meth:`forward` returns the whole
        prediction on every rank. Gradients: see ``gather_sequence`` (average them over the group, as DDP
        or FSDP over every rank does). Packs are refused.

        Raises:
            ValueError: ``num_heads`` not divisible by the group's size (named in the message).
        """
        if group is not None:
            _sp.SequenceShard.build(group, 1, self.config.num_heads)  # the heads check, now
        self._sequence.group = group

    @property
    def sequence_group(self) -> Any:
        """The sequence group set by :meth:`set_sequence_group`, or None."""
        return self._sequence.group

    # -- forward -----------------------------------------------------------------------------------

    def forward(
        self,
        x: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
        timestep: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Predict the flow velocity of a batch, or of a pack of samples of any shapes.

        Args:
            x: (B, C_in, T, H, W) noisy latent, any float dtype; T, H, W divisible by ``patch_size``. Or a
                *pack*: a list or tuple of N latents (C_in, T_i, H_i, W_i) of any shapes (each divisible by
                the patch), run as one step in which every sample attends only to itself and its own text
                (see :mod:`lightning_adaptiveload.models.packing`).
            timestep: (B,) diffusion time, float, in the model's units (rectified-flow t in [0, 1] x 1000);
                or (B, S), one time per token in patch order (T, H, W flattened), as Wan 2.2 TI2V uses.
                For a pack: (N,).
            context: (B, L, text_dim) text states, or None for no text (cross-attention is skipped; its
                parameters get zero gradients while training, so that DDP sees every parameter). For a
                pack: (N, L, text_dim), each sample's text zero padded to L.
            context_mask: (B, L) bool, True at real text tokens; None means all are real.

        Returns:
            (B, C_out, T, H, W) in the dtype of the head's output (fp32 in fp32 training, bf16 under
            bf16 autocast); for a pack, a list of N tensors (C_out, T_i, H_i, W_i), the same as each sample
            run alone.
        """
        if isinstance(x, (list, tuple)):
            if self.sequence_group is not None:
                raise ValueError(
                    "VideoDiT: a pack (a list of latents) under sequence parallelism is not supported; give "
                    "bucketed batches (B, C, T, H, W), or call set_sequence_group(None)"
                )
            return self._forward_pack(list(x), timestep, context, context_mask)
        grid = self._check_input(x)
        b = x.shape[0]
        seq = grid[0] * grid[1] * grid[2]
        if timestep.shape not in ((b,), (b, seq)):
            raise ValueError(
                f"timestep must have shape (B,) = ({b},) or, one per token, (B, S) = ({b}, {seq}); got "
                f"{tuple(timestep.shape)}"
            )
        h, e, block_args = self._dense_prologue(x, grid, timestep, context, context_mask)
        if self.sequence_group is not None:  # this rank's shard of the tokens, their RoPE rows and times
            shard = _sp.SequenceShard.build(self.sequence_group, seq, self.config.num_heads)
            e0, cos, sin, ctx, ctx_mask = block_args
            if timestep.dim() == 2:
                e, e0 = shard.shard(e), shard.shard(e0)
            h, block_args = shard.shard(h), (e0, shard.shard(cos, 0), shard.shard(sin, 0), ctx, ctx_mask)
            for block in self.blocks:
                h = block(h, *block_args, shard)
            return self._keep_text_path(self.unpatchify(shard.gather(self.head(h, e)), grid), ctx)
        for block in self.blocks:
            # Each block checkpoints itself (its checkpoint_policy), so a compiled block includes it.
            h = block(h, *block_args)
        return self._keep_text_path(self.unpatchify(self.head(h, e), grid), block_args[3])

    def _dense_prologue(
        self,
        x: torch.Tensor,
        grid: tuple[int, int, int],
        timestep: torch.Tensor,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """A checked batch ``x`` (B, C_in, T, H, W) of token grid ``grid``: ``(h, e, block_args)``, every block
        called as ``block(h, *block_args)``; resolves the attention kernels and the checkpointed blocks. The
        one prologue of a bucketed batch and of a pack that is one."""
        b, seq = x.shape[0], grid[0] * grid[1] * grid[2]
        h = self._embed_patches(x)  # (B, S, D)
        e, e0 = self._embed_time(timestep)  # (B, D) and (B, 6, D), or (B * S, ...) per token
        if timestep.dim() == 2:  # per token: (B, S, D) and (B, S, 6, D)
            e, e0 = e.unflatten(0, (b, seq)), e0.unflatten(0, (b, seq))
        ctx, context_mask = self._embed_text(context, context_mask, b)
        cos, sin = self._rope(grid, x.device)
        self._apply_attention_backend(x.device)
        # Memory is sized per GPU: under sequence parallelism a block holds its shard, S/G tokens (padded).
        group = self.sequence_group
        local = seq if group is None else _sp.SequenceShard.build(group, seq, self.config.num_heads).local_len
        self._choose_checkpointing(b, local, 0 if context is None else context.shape[1])
        return h, e, (e0, cos, sin, ctx, context_mask)

    def _forward_pack(
        self,
        latents: list[torch.Tensor],
        timestep: torch.Tensor,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """:meth:`forward` of a pack; the two routes of :func:`~lightning_adaptiveload.models.packing.attention_route`.

        Equal token counts (one sample included): a batch (N, L, D) with per-sample rows, every block called
        exactly as for a bucketed batch. Mixed: one sequence (1, S, D), every block called with
        ``segments=`` (:class:`~lightning_adaptiveload.models.packing.PackSegments`).
        """
        h, e, block_args, segments, grids, lens = self.pack_prologue(latents, timestep, context, context_mask)
        for block in self.blocks:  # the bucketed call (no segments): a compiled block shares batches' graphs
            h = block(h, *block_args) if segments is None else block(h, *block_args, segments=segments)
        ctx = block_args[3]
        if segments is None:
            out = self._keep_text_path(self.head(h, e), ctx)  # (N, L, C_out * patch volume)
            if all(g == grids[0] for g in grids):
                return list(self.unpatchify(out, grids[0]).unbind(0))
            return [self.unpatchify(out[i : i + 1], g)[0] for i, g in enumerate(grids)]
        out = self._keep_text_path(self.head(h, e, segments), ctx)[0]  # (S_total, C_out * patch volume)
        return [self.unpatchify(part[None], g)[0] for part, g in zip(out.split(lens), grids)]

    def pack_prologue(
        self,
        latents: list[torch.Tensor],
        timestep: torch.Tensor,
        context: torch.Tensor | None,
        context_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple, Any, list[tuple[int, int, int]], list[int]]:
        """A pack's inputs to its blocks: ``(h, e, block_args, segments, grids, lens)``, every block called as
        ``block(h, *block_args, segments=segments)`` (without ``segments`` on the dense route, where it is None). Also resolves the attention
        kernels and the checkpointed blocks for the pack, as :meth:`forward` does (the kernel warm-up,
        :mod:`~lightning_adaptiveload.models.kernel_warmup`, runs one block on it)."""
        n = len(latents)
        if n == 0 or timestep.shape != (n,):
            raise ValueError(
                f"a pack needs N >= 1 latents and timestep of shape (N,) = ({n},), got {tuple(timestep.shape)}"
            )
        for i, lat in enumerate(latents):
            if not isinstance(lat, torch.Tensor) or lat.dim() != 4:
                raise ValueError(
                    f"a pack is a list of latents (C, T, H, W); item {i} is "
                    f"{tuple(lat.shape) if isinstance(lat, torch.Tensor) else type(lat).__name__}"
                )
        grids = [self._check_input(lat[None]) for lat in latents]
        lens = [f * hh * w for f, hh, w in grids]
        device = latents[0].device
        route = _packing.attention_route(lens)
        varlen = (
            route == "segments"
            and device.type != "meta"
            and _packing.varlen_applies_to(device, self._attention_dtype(device))
        )
        if not torch.compiler.is_compiling():
            _packing.log_route_once(route, device, varlen, n)
        if route == "dense" and all(g == grids[0] for g in grids):  # the bucketed batch of these samples
            batch = latents[0][None] if n == 1 else torch.stack(latents)
            return (
                *self._dense_prologue(batch, grids[0], timestep, context, context_mask),
                None,
                grids,
                lens,
            )
        tokens = [self._embed_patches(lat[None]) for lat in latents]  # (1, S_i, D) each
        if route == "dense":  # equal counts on different grids: a batch with per-sample RoPE tables
            h = torch.cat(tokens, dim=0)  # (N, L, D)
            tables = [self._rope(g, device) for g in grids]
            cos, sin = torch.stack([c for c, _ in tables]), torch.stack([s for _, s in tables])
        else:
            h = torch.cat(tokens, dim=1)  # (1, S_total, D)
            cos, sin = _packing.packed_rope(self, grids, device)
        e, e0 = self._embed_time(timestep)  # (N, D), (N, 6, D) fp32
        ctx, context_mask = self._embed_text(context, context_mask, n)
        segments = None
        if route == "segments":
            segments = _packing.PackSegments.build(
                lens,
                device,
                context_mask if ctx is not None else None,
                0 if ctx is None else ctx.shape[1],
                varlen,
            )
            # The sample count N sizes the per-sample rows and text: dynamic in the first graph too.
            _packing.mark_dynamic((e, e0, ctx, context_mask), 0)
        self._apply_attention_backend(device)
        text_len = 0 if context is None else context.shape[1]
        self._choose_checkpointing(*((n, lens[0]) if segments is None else (1, sum(lens))), text_len)
        return h, e, (e0, cos, sin, ctx, context_mask), segments, grids, lens

    def forward_packed(
        self,
        latents: list[torch.Tensor],
        timestep: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """``self(list(latents), timestep, context, context_mask)``: a pack through :meth:`forward` (and so
        through ``__call__``, its hooks and FSDP's).

        Args: latents: N tensors (C_in, T_i, H_i, W_i); timestep (N,); context (N, L, text_dim) or None;
        context_mask (N, L) bool or None. Returns N tensors (C_out, T_i, H_i, W_i).
        """
        return self(list(latents), timestep, context, context_mask)

    # -- forward's parts -------------------------------------------------------------------------

    def _stream_dtype(self, device: torch.device) -> torch.dtype:
        """The residual stream's dtype: fp32 (Wan keeps the gated adds in fp32), fp64 for fp64 parameters, or
        the parameters' own low precision without autocast ("bf16-true"), where matmul inputs must match."""
        param_dtype = self.patch_embedding.weight.dtype
        if param_dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled(device.type):
            return param_dtype
        return torch.float64 if param_dtype == torch.float64 else torch.float32

    def _attention_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype attention's inputs will have: autocast's where it is on, else the parameters'."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.patch_embedding.weight.dtype

    def _embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C_in, T, H, W) -> (B, S, D) tokens in the stream dtype, contiguous."""
        param_dtype = self.patch_embedding.weight.dtype
        h = (
            self.patch_embedding(x.to(param_dtype))
            .flatten(2)
            .transpose(1, 2)
            .to(self._stream_dtype(x.device))
        )
        # Contiguous, not a transposed view: every block then sees inputs of one layout, so a compiled block
        # serves the first block too (a view input would add a guard on its base and a second graph).
        return h.contiguous()

    def _embed_time(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep (B,) or (B, S) -> e (B', D) and e0 (B', 6, D), fp32, B' = timestep.numel()."""
        # Meta tensors (shape and FLOP analysis) have no autocast.
        device = timestep.device
        no_autocast = nullcontext() if device.type == "meta" else torch.autocast(device.type, enabled=False)
        with no_autocast:
            w_dtype = self.time_embedding[0].weight.dtype
            t_emb = sinusoidal_embedding(timestep.flatten(), self.config.freq_dim).to(w_dtype)
            e = self.time_embedding(t_emb).float()
            e0 = self.time_projection(e.to(w_dtype)).float().unflatten(1, (6, self.config.dim))
        return e, e0

    def _embed_text(
        self, context: torch.Tensor | None, context_mask: torch.Tensor | None, b: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Validated text states (B, L, text_dim) -> (B, L, D) in the parameters' dtype, and the bool mask."""
        if context is None:
            return None, None
        if context.dim() != 3 or context.shape[0] != b or context.shape[2] != self.config.text_dim:
            raise ValueError(
                f"text states must have shape (B={b}, L, text_dim={self.config.text_dim}), got "
                f"{tuple(context.shape)}; set text_dim in the model config to the text encoder's width"
            )
        if context_mask is not None and context_mask.shape != context.shape[:2]:
            raise ValueError(
                f"text_mask shape {tuple(context_mask.shape)} does not match text {tuple(context.shape[:2])}"
            )
        if context_mask is not None:
            context_mask = context_mask.to(device=context.device, dtype=torch.bool)
        pad = padded_text_len(self.config, context.shape[1]) - context.shape[1]
        if context_mask is None and (pad or self.config.text_len is not None):
            # With a fixed text_len the mask is always there, also for a prompt that fills it: a batch
            # without one would be another compiled graph and another cuDNN attention graph.
            context_mask = torch.ones(context.shape[:2], dtype=torch.bool, device=context.device)
        if pad:
            # Masked-out zero rows up to config.text_len, or a multiple of TEXT_ALIGN: exact (every attention
            # path honours the mask). One key length for every batch spares cuDNN attention a graph build
            # per new length (see VideoDiTConfig.text_len); aligned rows keep a compiled block to one graph
            # (inductor guards on the length's alignment, and compiled the two cases apart).
            context = torch.nn.functional.pad(context, (0, 0, 0, pad))
            context_mask = torch.nn.functional.pad(context_mask, (0, pad), value=False)
        ctx = self.text_embedding(context.to(self.patch_embedding.weight.dtype))
        # The text length varies by batch: dynamic in a compiled block's first graph (not left to dynamo,
        # which made it static there and compiled again at the next length).
        _packing.mark_dynamic((ctx, context_mask), 1)
        return ctx, context_mask

    def _keep_text_path(self, out: torch.Tensor, ctx: torch.Tensor | None) -> torch.Tensor:
        if ctx is None and self.training and torch.is_grad_enabled():
            # DDP expects a gradient for every parameter at every step, and FSDP reduce-scatters those that
            # have one (ranks that disagree fail); a batch without text would leave the text path out of the
            # graph. A zero-weighted sum keeps it in (zero gradients) for one reduction per tensor: here the
            # text embedding's, each block its cross-attention's (FSDP gathers a unit only in its forward).
            out = out + _zero_sum(self.text_embedding)
        return out

    # -- analytic cost -----------------------------------------------------------------------------

    def flops_per_sample(self, seq_len: int, text_len: int = 0) -> int:
        """Forward FLOPs of one sample of ``seq_len`` tokens; see :func:`forward_flops` for the formula."""
        return forward_flops(self.config, seq_len, padded_text_len(self.config, text_len))

    def flops(self, batch_size: int, seq_len: int, text_len: int = 0) -> int:
        """Forward FLOPs of a batch of ``batch_size`` samples of ``seq_len`` tokens; see :meth:`flops_per_sample`."""
        return int(batch_size) * self.flops_per_sample(seq_len, text_len)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

"""Helpers every training step on the adaptive data path needs: token-weighted loss and per-rank noise.

The planned batches differ between ranks (a rank may hold 3 long videos while another holds 40 images),
and DDP averages the ranks' gradients with equal weight. :func:`token_weighted_loss` scales each rank's
summed per-token loss so that this average is the gradient of the per-token mean over the **global**
batch; :func:`rank_noise_generator` gives each rank its own noise stream although Lightning seeds every
rank alike. See ``docs/data_path.md`` (the batch contract) for the batch keys they read.
"""

from __future__ import annotations

import torch

from lightning_adaptiveload import _dist

__all__ = ["global_token_count", "token_weighted_loss", "rank_noise_generator"]


def global_token_count(
    local_tokens: int, global_tokens: int | torch.Tensor = -1, world_size: int | None = None
) -> int:
    """Tokens of this step summed over all ranks.

    Args:
        local_tokens: this rank's tokens (``batch["num_tokens"]``; 0 for an empty batch).
        global_tokens: ``batch["global_tokens"]``: the sum the planner knows, or -1 when unknown (then one
            small all-gather of the ranks' counts runs: every rank must call this at the same step).
        world_size: data-parallel ranks; None: from the process group (1 without one).

    Raises:
        ValueError: ``global_tokens`` is smaller than ``local_tokens`` (the data path reported a per-rank
            count).
    """
    given = int(global_tokens.item() if torch.is_tensor(global_tokens) else global_tokens)
    local_tokens = int(local_tokens)
    if given >= 0:
        if given < local_tokens:
            raise ValueError(
                f"batch['global_tokens'] = {given} is smaller than this rank's {local_tokens} tokens; "
                "the data path must report the sum over all ranks (or -1 when unknown)"
            )
        return given
    world = _dist.rank_and_world()[1] if world_size is None else int(world_size)
    if world == 1:
        return local_tokens
    # One small collective; identity when no process group is initialised.
    return int(round(sum(row[0] for row in _dist.all_gather_floats([float(local_tokens)]))))


def token_weighted_loss(
    loss_sum: torch.Tensor,
    local_tokens: int,
    global_tokens: int | torch.Tensor = -1,
    world_size: int | None = None,
) -> torch.Tensor:
    """This rank's share of the global per-token mean: ``loss_sum * world_size / global_tokens``.

    DDP averages gradients over ranks, so back-propagating this on every rank gives exactly the gradient
    of ``(sum of all ranks' per-token losses) / (all ranks' tokens)``: every token of the global batch
    weighs the same, however unevenly the tokens are split. A step at which every rank's batch is empty
    gives 0 (not nan); an empty batch on one rank adds nothing (``loss_sum`` of an empty batch is 0).

    Args:
        loss_sum: scalar tensor, the **sum** over this rank's tokens of the per-token loss (e.g. the squared
            error summed over the batch and divided by the latent elements per token).
        local_tokens: this rank's tokens.
        global_tokens: the sum over ranks, or -1 (see :func:`global_token_count`).
        world_size: data-parallel ranks; None: from the process group.

    Returns:
        Scalar tensor to back-propagate. With gradient accumulation, Lightning averages the micro-batches,
        each normalised by its own global token count.

    Example::

        err = (pred - target).square().sum() / elems_per_token
        loss = token_weighted_loss(err, batch["num_tokens"], batch["global_tokens"], self.trainer.world_size)
    """
    world = _dist.rank_and_world()[1] if world_size is None else int(world_size)
    total = global_token_count(local_tokens, global_tokens, world)
    return loss_sum * (world / max(total, 1))


def rank_noise_generator(
    device: torch.device | str = "cpu", rank: int | None = None, seed: int | None = None
) -> torch.Generator:
    """A random generator on ``device`` seeded differently on every rank.

    ``seed_everything`` gives every rank the same seed, so ``torch.randn`` would draw the same noise (and
    timesteps) on all ranks: samples at the same batch position would share noise. Offsetting by the rank
    keeps runs reproducible and ranks independent.

    The meta device has no generator (``torch.Generator("meta")`` raises "META device type not an
    accelerator"), but ``torch.randn(..., device="meta", generator=g)`` takes a CPU one: for meta, a CPU
    generator is returned, so that a step run for its shapes alone (the ``LoadBalanceMonitor``'s FLOP count
    on a meta copy of the module) draws as on a real device.

    Args:
        device: where the generator draws (the device of the latents).
        rank: global rank; None: from the process group (0 without one).
        seed: base seed; None: ``torch.initial_seed()`` (what ``seed_everything`` set).

    Returns:
        ``torch.Generator`` seeded with ``(seed + 1_000_003 * rank) mod 2**63`` (on the CPU for ``device``
        meta); keep it and pass it as ``generator=`` to ``torch.randn`` / ``torch.rand``.
    """
    rank = _dist.rank_and_world()[0] if rank is None else int(rank)
    base = torch.initial_seed() if seed is None else int(seed)
    where = torch.device(device)
    if where.type == "meta":
        where = torch.device("cpu")
    return torch.Generator(device=where).manual_seed((base + 1_000_003 * rank) % (2**63))

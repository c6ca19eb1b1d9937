"""The planning simulator across sequence-parallel degrees: for a mix and a GPU count, which degree and
schedule it expects to be fastest. Simulated, never measured.

At ``N`` GPUs and degree G the epoch is planned, by the real planner, for ``N / G`` data-parallel groups
(:mod:`~lightning_adaptiveload.planning.groups`), each group's batch holding up to ``G * max_tokens`` tokens
and costing one GPU of the group ``c0 + B * (cost(S) / G + comm(S, G))``
(:meth:`~lightning_adaptiveload.planning.cost_model.CostModel.sequence_parallel`): the simulator
(:func:`~lightning_adaptiveload.tools.simulate.simulate`) replays it with those times and plans with that
model. Every row's ``tokens_per_s`` is then the job's (all groups' tokens over the summed slowest group's
step time), comparable across degrees at one GPU count. A degree at which a bucket does not fit
``G * max_tokens``, or that leaves fewer than 2 groups (the simulator balances at least 2), is reported as
not simulated, with the reason.

What it leaves out: the all-to-all at the bandwidth of :class:`~lightning_adaptiveload.planning.cost_model.SequenceComm`
(no contention, no overlap), cross-attention's text keys computed on every GPU of a group (counted as
divided), the sequence padding to a multiple of G, and the gradient all-reduce (the same bytes per GPU at
every degree). ``benchmarks/sp/gpu_sp.sh`` measures the step.

Example:
    >>> from lightning_adaptiveload.tools.simulate_sequence import simulate_degrees
    >>> res = simulate_degrees("tiny", gpu_counts=[4], degrees=[1, 2], max_tokens=512,
    ...                        variants=["lockstep"], min_steps_per_rank=8)
    >>> sorted({(r["gpus"], r["degree"]) for r in res.rows})
    [(4, 1), (4, 2)]
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_adaptiveload.monitor.report import jsonable
from lightning_adaptiveload.planning.cost_model import CostModel, SequenceComm

__all__ = ["DegreeResult", "model_comm", "model_cost", "simulate_degrees"]

_KEYS = ("tokens_per_s", "wait_share", "cv_mean", "token_fill", "steps", "peak_tokens")


def _preset(name: str) -> Any:
    from lightning_adaptiveload.models.config import VideoDiTConfig

    return VideoDiTConfig.preset(name)


def model_comm(preset: str, link_gb_per_s: float = 300.0, passes: float = 3.0) -> SequenceComm:
    """The all-to-all cost of a ``VideoDiT`` preset (``"wan-1.3b"``, ``"wan-14b"``): its width and depth, bf16."""
    cfg = _preset(preset)
    return SequenceComm(hidden=cfg.dim, layers=cfg.num_layers, link_gb_per_s=link_gb_per_s, passes=passes)


def model_cost(preset: str, text_len: int = 512) -> CostModel:
    """An estimated cost model (seconds per sample on one H100/H200) of a ``VideoDiT`` preset: the fit of
    Wan 2.1 1.3B (:meth:`CostModel.default`) with its linear and attention terms scaled by the preset's FLOPs
    per token and per token pair (:func:`~lightning_adaptiveload.models.config.forward_flops`) against
    ``wan-1.3b``'s. An estimate at the 1.3B fit's utilisation, not a measurement (H200 and H100 have the
    same dense bf16 peak); ``wan-1.3b`` gives the fit itself.
    """
    from lightning_adaptiveload.models.config import forward_flops

    def terms(cfg: Any) -> tuple[float, float]:
        # forward_flops is a quadratic polynomial in S: recover its S and S^2 coefficients exactly.
        f0, f1, f2 = (forward_flops(cfg, s, text_len) for s in (0, 1, 2))
        quad = (f2 - 2 * f1 + f0) / 2
        return float(f1 - f0 - quad), float(quad)

    base, model = terms(_preset("wan-1.3b")), terms(_preset(preset))
    fit = CostModel.default()
    return CostModel(
        kind="quadratic", alpha=fit.alpha * model[0] / base[0], beta=fit.beta * model[1] / base[1]
    )


@dataclass
class DegreeResult:
    """What :func:`simulate_degrees` found: one row per (GPU count, degree, variant) simulated, the skipped
    ones with their reason, and per GPU count the fastest row."""

    rows: list[dict[str, Any]]
    skipped: list[dict[str, Any]]
    meta: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def best(self, gpus: int) -> dict[str, Any] | None:
        """The row with the highest simulated tokens/s at ``gpus`` GPUs (None: nothing simulated there)."""
        rows = [r for r in self.rows if r["gpus"] == gpus]
        return max(rows, key=lambda r: r["tokens_per_s"]) if rows else None

    def verdicts(self) -> list[str]:
        """One line per GPU count: the degree and schedule expected to be fastest (simulated)."""
        out = []
        for n in sorted({r["gpus"] for r in self.rows}):
            b = self.best(n)
            assert b is not None
            base = [
                r for r in self.rows if r["gpus"] == n and r["degree"] == 1 and r["variant"] == b["variant"]
            ]
            vs = (
                f", x{b['tokens_per_s'] / base[0]['tokens_per_s']:.3f} of degree 1"
                if base and b["degree"] != 1
                else ""
            )
            out.append(
                f"{n} GPUs: degree {b['degree']} ({b['groups']} groups), {b['variant']} expected fastest "
                f"(simulated): {b['tokens_per_s']:,.0f} tokens/s, wait {100 * b['wait_share']:.1f}%{vs}"
            )
        return out

    def table(self) -> str:
        """A plain-text table (every figure simulated)."""
        head = (
            f"{'GPUs':>5}{'degree':>7}{'groups':>7}  {'config':<22}{'tokens/s':>11}{'x deg 1':>9}{'wait':>8}"
            f"{'CV mean':>9}{'tok fill':>9}{'comm':>7}{'steps':>7}"
        )
        lines = [
            "simulated (the real planner, replayed with a cost model; not measured)",
            head,
            "-" * len(head),
        ]
        for r in self.rows:
            lines.append(
                f"{r['gpus']:>5}{r['degree']:>7}{r['groups']:>7}  {r['variant']:<22}{r['tokens_per_s']:>11,.0f}"
                + (f"{'-':>9}" if math.isnan(r["vs_degree_1"]) else f"{r['vs_degree_1']:>9.3f}")
                + f"{100 * r['wait_share']:>7.1f}%{100 * r['cv_mean']:>8.1f}%"
                f"{100 * r['token_fill']:>8.1f}%{100 * r['comm_share']:>6.1f}%{r['steps']:>7}"
            )
        for s in self.skipped:
            lines.append(f"{s['gpus']:>5}{s['degree']:>7}  not simulated: {s['why']}")
        return "\n".join(lines + self.verdicts())

    def to_dict(self) -> dict[str, Any]:
        return jsonable(
            {
                "meta": self.meta,
                "rows": self.rows,
                "skipped": self.skipped,
                "notes": self.notes,
                "verdicts": self.verdicts(),
            }
        )


def _comm_share(
    cost: CostModel, comm: SequenceComm, degree: int, shares: Mapping[Any, float], patch: Any
) -> float:
    """The all-to-all's share of one GPU's time over the mix's tokens (per sample, ``c0`` left out)."""
    from lightning_adaptiveload.planning.sizing import tokens_per_sample

    kappa = comm.seconds_per_token(degree)
    sp = cost.sequence_parallel(degree, comm)
    toks = [(tokens_per_sample(sh[1:], patch), q) for sh, q in shares.items()]
    total = sum(q * sp.cost(s) for s, q in toks)
    return sum(q * kappa * s for s, q in toks) / total if total > 0 else math.nan


def simulate_degrees(
    source: Any = "wan21_480p",
    *,
    gpu_counts: Sequence[int] = (16, 64),
    degrees: Sequence[int] = (1, 2, 4),
    max_tokens: int = 32760,
    times: CostModel | Mapping[str, Any] | None = None,
    comm: SequenceComm | Mapping[str, Any] | None = None,
    variants: Sequence[str] = ("equal_tokens", "lockstep", "packed"),
    min_steps_per_rank: int = 100,
    num_workers: int = 1,
    seed: int = 0,
    patch_size: Sequence[int] = (1, 2, 2),
) -> DegreeResult:
    """Simulate every degree at every GPU count (``max_tokens`` per GPU; ``times``: a cost model in seconds
    per sample on one GPU, default :meth:`CostModel.default`), planning with the group's cost model.

    Raises:
        ValueError: a degree < 1, a cost model of another kind than quadratic (the all-to-all is priced in
            seconds), or a bad setting of the simulator (its message).
    """
    from lightning_adaptiveload.tools.replay import bucket_shares
    from lightning_adaptiveload.tools.simulate import _load_source, simulate
    from lightning_adaptiveload.tools.simulate_settings import SimulateSettings

    cost = CostModel.default() if times is None else CostModel.from_dict(times)
    link = SequenceComm.of(comm)
    mix, fixed = _load_source(source)
    shares = bucket_shares(mix if mix is not None else fixed)
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for n in sorted(set(int(v) for v in gpu_counts)):
        base: dict[str, float] = {}
        for g in sorted(set(int(v) for v in degrees)):
            sp = cost.sequence_parallel(g, link)
            if n % g or n // g < 2:
                why = f"{n} GPUs do not form 2 or more groups of {g}"
                skipped.append({"gpus": n, "degree": g, "why": why})
                continue
            settings = SimulateSettings(
                world_sizes=[n // g],
                variants=list(variants),
                max_tokens=int(max_tokens) * g,
                recommend=False,
                min_steps_per_rank=min_steps_per_rank,
                num_workers=num_workers,
                seed=seed,
                patch_size=patch_size,
            )
            try:
                res = simulate(
                    mix if mix is not None else fixed,
                    settings,
                    times=sp,
                    plan_cost_model=sp,
                    plots=False,
                    progress=False,
                )
            except ValueError as err:
                skipped.append({"gpus": n, "degree": g, "why": str(err)})
                continue
            share = _comm_share(cost, link, g, shares, settings.patch_size)
            for r in res.rows:
                if r["variant"] not in variants:
                    continue
                if g == 1:
                    base[r["variant"]] = r["tokens_per_s"]
                ref = base.get(r["variant"])
                rows.append(
                    {
                        "gpus": n,
                        "degree": g,
                        "groups": n // g,
                        "variant": r["variant"],
                        "schedule": r["schedule"],
                        **{k: r[k] for k in _KEYS},
                        "tokens_per_s_per_gpu": r["tokens_per_s"] / n,
                        "vs_degree_1": r["tokens_per_s"] / ref if ref else math.nan,
                        "comm_share": share,
                        "simulated": True,
                    }
                )
    meta = {
        "simulated": True,
        "source": getattr(mix, "source", None) or getattr(mix, "name", None) or str(source),
        "max_tokens_per_gpu": int(max_tokens),
        "cost_model": cost.to_dict(),
        "comm": link.to_dict(),
        "gpu_counts": sorted(set(int(v) for v in gpu_counts)),
        "degrees": sorted(set(int(v) for v in degrees)),
        "variants": list(variants),
        "min_steps_per_rank": min_steps_per_rank,
        "seed": seed,
    }
    return DegreeResult(rows=rows, skipped=skipped, meta=meta)

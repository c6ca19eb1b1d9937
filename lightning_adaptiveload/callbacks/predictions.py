"""``PredictionWriter``: writes what ``predict_step`` returns, one JSON line per sample, and says where.

For a module whose ``predict_step`` returns ``{"keys": [...], <name>: Tensor (B,) or list, ...}`` (the
``VideoDiTModule``'s per-sample loss, ``{"keys", "loss"}``): each rank writes
``<output_dir>/predictions_rank<r>.jsonl`` with one ``{"key": ..., "<name>": ...}`` line per sample, starting
each predict run with an empty file, and rank 0 prints the folder and the files at the end.
"""

from __future__ import annotations

import json
import os
from typing import Any

from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

__all__ = ["PredictionWriter"]


class PredictionWriter(BasePredictionWriter):
    """Per-sample predictions to ``<output_dir>/predictions_rank<r>.jsonl``.

    Args:
        output_dir: the folder of the files (made when predict starts).
    """

    def __init__(self, output_dir: str = "predictions") -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self.samples = 0

    def _path(self, trainer: Any) -> str:
        return os.path.join(self.output_dir, f"predictions_rank{trainer.global_rank}.jsonl")

    @override
    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        open(self._path(trainer), "w", encoding="utf-8").close()  # a new run does not append to the last
        self.samples = 0

    @override
    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not isinstance(prediction, dict) or "keys" not in prediction:
            raise TypeError(
                f"PredictionWriter: predict_step of {type(pl_module).__name__} returned "
                f"{type(prediction).__name__}; it writes a dict {{'keys': [...], name: per-sample values}}"
            )
        keys = list(prediction["keys"])
        columns = {
            name: (value.tolist() if hasattr(value, "tolist") else list(value))
            for name, value in prediction.items()
            if name != "keys"
        }
        with open(self._path(trainer), "a", encoding="utf-8") as f:
            for i, key in enumerate(keys):
                f.write(json.dumps({"key": key, **{n: v[i] for n, v in columns.items()}}) + "\n")
        self.samples += len(keys)

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # At teardown, not on_predict_end: after the progress bar's last line, so this line is the last.
        if (
            stage != "predict"
            or not getattr(trainer, "is_global_zero", True)
            or not os.path.isdir(self.output_dir)
        ):
            return
        files = sorted(f for f in os.listdir(self.output_dir) if f.startswith("predictions_rank"))
        print(
            f"\n[adaptiveload] predictions (one JSON line per sample): {os.path.abspath(self.output_dir)}: "
            f"{', '.join(files)}",
            flush=True,
        )

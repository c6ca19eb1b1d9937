"""Videos and images to latent shards with Wan's VAE (and umT5), run as ``Trainer.predict``.

The pipeline, per input file::

    decode (PyAV / Pillow) -> frames at the target fps, Wan's 4k+1 count, at most max_frames
    -> resize + centre crop to a bucket (or native size rounded to 16) -> pixels in [-1, 1]
    -> AutoencoderKLWan.encode(...).latent_dist.mode() -> (z - latents_mean) / latents_std
    -> <key>.latent.npy (16, 1 + (T-1)/4, H/8, W/8) [+ <key>.text.npy (L, 4096)] + <key>.json

It runs as ``Trainer.predict`` (:func:`ingest`): the inputs still to do are split over the ranks,
each rank's :class:`ShardPredictionWriter` writes its own shards, and rank 0 writes ``index.json`` for all
of them at the end. A rerun skips every input whose sample is in a complete shard (shards are renamed into
place only when complete, so a killed run leaves nothing half-written that counts as done), and every
input an earlier run skipped (recorded in ``ingest-skipped-r<rank>.jsonl``: a file that failed to decode
fails again; delete those files to retry).

Inputs are untrusted: decoding is bounded by :class:`~lightning_adaptiveload.ingest.media.DecodeLimits`, and
under ``on_error="skip"`` every per-file failure, whatever raised it, is a recorded, counted skip.

The decode, frame and sizing functions are plain Python in :mod:`lightning_adaptiveload.ingest.media`
(re-exported here); this module holds the Lightning parts: :class:`IngestModule`,
:class:`ShardPredictionWriter` and :func:`ingest`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from lightning_adaptiveload.ingest.demo import (
    DEMO_ENCODER,
    DEMO_NOTE,
    is_demo_encoder,
    tiny_random_text_encoder,
    tiny_random_vae,
)
from lightning_adaptiveload.ingest.encode import encode_text, encode_video
from lightning_adaptiveload.ingest.media import (
    IMAGE_EXTENSIONS,
    INPUT_REASONS,
    VIDEO_EXTENSIONS,
    DecodeLimits,
    IngestItem,
    InputError,
    choose_bucket,
    decode_input,
    find_inputs,
    parse_buckets,
    read_manifest,
    sample_frame_indices,
    size_plan,
    wan_frame_count,
)
from lightning_adaptiveload.ingest.output import (  # noqa: F401  (done_keys, skipped_inputs: public here too)
    _SHARD,
    _STALE_TMP,
    _WRITER_INDEX,
    DEMO_MARKER,
    MAX_SKIP_LOG_BYTES,
    _complete_shards,
    done_keys,
    skipped_inputs,
)
from lightning_adaptiveload.ingest.settings import IngestSettings

log = logging.getLogger(__name__)

__all__ = [
    "DecodeLimits",
    "IngestItem",
    "IngestSettings",
    "IngestModule",
    "ShardPredictionWriter",
    "choose_bucket",
    "decode_input",
    "done_keys",
    "encode_text",
    "encode_video",
    "find_inputs",
    "ingest",
    "parse_buckets",
    "read_manifest",
    "sample_frame_indices",
    "size_plan",
    "skipped_inputs",
    "wan_frame_count",
    "write_index",
]


# --------------------------------------------------------------------------------------------------
# Lightning: dataset, predict module, writer
# --------------------------------------------------------------------------------------------------


class IngestDataset(torch.utils.data.Dataset):
    """Decodes one input per item; a failure becomes an error record instead of an exception, so that a
    corrupt file does not kill the data-loader workers (the writer counts it, or raises).

    Every exception of one input's decode is its failure (a hostile file can make a decoder raise
    anything); only the input's own record is affected.
    """

    def __init__(
        self,
        items: Sequence[IngestItem],
        fps: float | None,
        max_frames: int,
        buckets,
        limits: DecodeLimits | None = None,
    ) -> None:
        self.items, self.fps, self.max_frames, self.buckets = list(items), fps, max_frames, buckets
        self.limits = DecodeLimits() if limits is None else limits

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.items[i]
        if item.error is not None:
            return _error_record(item, *item.error)
        try:
            pixels, meta = decode_input(item, self.fps, self.max_frames, self.buckets, self.limits)
        except InputError as err:
            return _error_record(item, err.reason, str(err))
        except Exception as err:  # noqa: BLE001 - see the class docstring
            return _error_record(item, "decode_error", f"{item.path}: {type(err).__name__}: {err}")
        return {"key": item.key, "path": item.path, "pixels": pixels, "meta": meta, "caption": item.caption}


def _error_record(item: IngestItem, reason: str, detail: str) -> dict[str, Any]:
    return {"key": item.key, "path": item.path, "error": reason, "detail": detail}


def _first(batch: list[dict]) -> dict:
    return batch[0]  # batch size 1: every clip has its own shape


class IngestModule(pl.LightningModule):
    """Predict-side module: encodes each decoded clip with the VAE (and the caption with umT5).

    Models are loaded in :meth:`configure_model` from local folders, so that each rank loads its own copy
    on its own device.

    Args:
        vae: folder of a diffusers ``AutoencoderKLWan`` (``config.json`` + weights), the model itself, or
            ``"tiny-random"`` (:func:`~lightning_adaptiveload.ingest.demo.tiny_random_vae`; NOT for training).
        text_encoder: folder of a transformers ``UMT5EncoderModel``, the model itself, ``"tiny-random"``
            (:func:`~lightning_adaptiveload.ingest.demo.tiny_random_text_encoder`, with its own tokenizer;
            NOT for training), or None (no text).
        tokenizer: folder of its tokenizer (default: ``text_encoder``'s folder) or the tokenizer itself.
        dtype: compute dtype of the encoders (``"float32"`` or ``"bfloat16"``).
    """

    def __init__(self, vae, text_encoder=None, tokenizer=None, dtype: str = "float32") -> None:
        super().__init__()
        self._vae_src, self._text_src, self._tok_src = vae, text_encoder, tokenizer
        self.compute_dtype = getattr(torch, dtype)
        self.vae = self.text_encoder = self.tokenizer = None
        # Set by ingest(): what predict_dataloader splits over the ranks.
        self.items: list[IngestItem] = []
        self.out = ""
        self.decode_args: tuple = (16.0, 81, None, None)
        self.num_workers = 0
        self.already_done = 0
        self.already_skipped = 0

    @override
    def predict_dataloader(self) -> torch.utils.data.DataLoader:
        """This rank's share of the inputs neither in a complete shard of ``out`` nor skipped before.

        Every rank reads the done and skipped sets from disk, then all wait at a barrier before any
        writes, so the remaining inputs split the same way on every rank, whatever the world size of
        earlier runs.
        """
        done = done_keys(self.out)
        skipped = skipped_inputs(self.out).keys() - done
        if self.global_rank == 0:
            # Shards of killed runs left half-written under temp names: their samples are not done. No
            # rank writes before the barrier below, so none of these is in use.
            for name in os.listdir(self.out):
                if _STALE_TMP.fullmatch(name):
                    os.remove(os.path.join(self.out, name))
        self.trainer.strategy.barrier("ingest_done_keys")
        pending = [it for it in self.items if it.key not in done and it.key not in skipped]
        self.already_done = sum(it.key in done for it in self.items)
        self.already_skipped = len(self.items) - len(pending) - self.already_done
        mine = pending[self.global_rank :: self.trainer.world_size]
        for cb in self.trainer.callbacks:
            if isinstance(cb, ShardPredictionWriter):
                cb.start_bar(self.global_rank, len(mine))
        return torch.utils.data.DataLoader(
            IngestDataset(mine, *self.decode_args),
            batch_size=1,
            collate_fn=_first,
            num_workers=self.num_workers,
        )

    @override
    def configure_model(self) -> None:
        if self.vae is not None:
            return
        if is_demo_encoder(self._vae_src):
            self.vae = tiny_random_vae()
            if self.compute_dtype != torch.float32:
                self.vae = self.vae.to(self.compute_dtype)
        elif isinstance(self._vae_src, (str, os.PathLike)):
            from diffusers import AutoencoderKLWan

            self.vae = AutoencoderKLWan.from_pretrained(
                os.fspath(self._vae_src), torch_dtype=self.compute_dtype
            )
        else:
            self.vae = self._vae_src
        self.vae.eval().requires_grad_(False)
        if is_demo_encoder(self._text_src):
            encoder, self.tokenizer = tiny_random_text_encoder()
            self.text_encoder = encoder.to(self.compute_dtype).eval().requires_grad_(False)
        elif self._text_src is not None:
            if isinstance(self._text_src, (str, os.PathLike)):
                from transformers import UMT5EncoderModel

                self.text_encoder = UMT5EncoderModel.from_pretrained(
                    os.fspath(self._text_src), torch_dtype=self.compute_dtype
                )
            else:
                self.text_encoder = self._text_src
            self.text_encoder.eval().requires_grad_(False)
            tok = self._tok_src if self._tok_src is not None else self._text_src
            if isinstance(tok, (str, os.PathLike)):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(os.fspath(tok))
            self.tokenizer = tok

    @override
    def predict_step(self, batch: dict, batch_idx: int) -> dict:
        if "error" in batch:
            return batch
        latent = encode_video(self.vae, batch["pixels"][None])[0]
        text = None
        if self.text_encoder is not None and batch["caption"]:
            text = encode_text(self.tokenizer, self.text_encoder, batch["caption"])
        meta = batch["meta"]
        if is_demo_encoder(self._vae_src) or is_demo_encoder(self._text_src):
            meta = {**meta, "demo": True}
        return {
            "key": batch["key"],
            "path": batch["path"],
            "latent": latent.cpu(),
            "text": None if text is None else text.cpu(),
            "meta": meta,
        }


class ShardPredictionWriter(BasePredictionWriter):
    """Writes each rank's encoded samples into its own shards ``r<rank>a<attempt>-NNNNNN.tar`` in ``out``,
    counts (or raises on) failed inputs, shows a progress bar with samples and hours of video on rank 0,
    and has rank 0 write ``index.json`` over all complete shards at the end.

    Args:
        out: output folder.
        samples_per_shard: samples per shard (a shard is complete, and its samples count as done, only
            when it is full or the job ends).
        latent_dtype: ``"float16"`` (half the bytes) or ``"float32"``.
        on_error: ``"skip"``: count the input and its reason, record it in ``ingest-skipped-r<rank>.jsonl``
            (a rerun does not try it again) and go on; ``"raise"``: stop with an error naming the file.
        progress: show a tqdm bar on rank 0 (samples, hours of video).
        metadata: stored in ``index.json``'s ``metadata`` (``ingest`` marks demo shards there).
    """

    def __init__(
        self,
        out: str,
        samples_per_shard: int = 100,
        latent_dtype: str = "float16",
        on_error: str = "skip",
        progress: bool = True,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(write_interval="batch")
        if on_error not in ("skip", "raise"):
            raise ValueError(f"on_error must be 'skip' or 'raise', got {on_error!r}")
        self.out, self.samples_per_shard, self.on_error, self.progress = (
            out,
            samples_per_shard,
            on_error,
            progress,
        )
        self.total = 0
        self.metadata = dict(metadata or {})
        self.latent_dtype = np.dtype(latent_dtype)
        self.writer = None
        self.written = 0
        self._in_shard = 0
        self.skipped: dict[str, int] = {}
        self.video_seconds = 0.0
        self._bar = None
        self._rank = 0
        self._t0 = 0.0

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        from lightning_adaptiveload.shards.writer import ShardWriter

        rank = trainer.global_rank
        os.makedirs(self.out, exist_ok=True)
        attempts = [
            int(m.group(2))
            for n in os.listdir(self.out)
            if (m := _SHARD.fullmatch(n)) and int(m.group(1)) == rank
        ]
        prefix = f"r{rank:03d}a{max(attempts, default=-1) + 1:03d}"
        self.writer = ShardWriter(
            self.out,
            prefix=prefix,
            max_samples_per_shard=self.samples_per_shard,
            max_bytes=None,
            patch_size=None,
            index_name=f".index-{prefix}.json",
        )
        self._rank = rank
        self._skip_log = os.path.join(self.out, f"ingest-skipped-r{rank:03d}.jsonl")
        self._t0 = time.perf_counter()

    def start_bar(self, rank: int, total: int) -> None:
        """Show the progress bar (rank 0 only) over this rank's ``total`` inputs."""
        self.total = total
        if rank == 0 and self.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="ingest (rank 0)", unit="sample")

    @override
    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx=0
    ) -> None:
        if "error" in prediction:
            if self.on_error == "raise":
                hint = INPUT_REASONS.get(prediction["error"], "fix or remove the file")
                raise RuntimeError(
                    f"ingest: {prediction['detail']} (reason: {prediction['error']}). What to do: {hint}; "
                    "or run with on_error='skip'"
                )
            self.skipped[prediction["error"]] = self.skipped.get(prediction["error"], 0) + 1
            # Recorded at once (and flushed): a killed run must not try the file again either.
            with open(self._skip_log, "a", encoding="utf-8") as f:
                f.write(json.dumps({k: prediction[k] for k in ("key", "path", "error", "detail")}) + "\n")
                f.flush()
            log.warning("ingest: skipped %s", prediction["detail"])
        else:
            meta = prediction["meta"]
            text = prediction["text"]
            self.writer.write(
                prediction["key"],
                prediction["latent"].numpy().astype(self.latent_dtype),
                text=None if text is None else text.numpy().astype(self.latent_dtype),
                meta=meta,
            )
            self.written += 1
            self._in_shard += 1
            if self._in_shard >= self.samples_per_shard:
                # Complete the shard now, not when the next sample comes: a killed run then loses at
                # most the samples of the shard in progress.
                self.writer.finish_shard()
                self._in_shard = 0
            if meta["fps"]:
                self.video_seconds += len(meta["frame_indices"]) / meta["fps"]
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(
                written=self.written,
                skipped=sum(self.skipped.values()),
                video_h=f"{self.video_seconds / 3600:.3f}",
            )

    @override
    def on_predict_end(self, trainer, pl_module) -> None:
        self.writer.close()
        if self._bar is not None:
            self._bar.close()
        trainer.strategy.barrier("ingest_written")
        if trainer.is_global_zero:
            if _complete_shards(self.out):
                write_index(self.out, metadata=self.metadata)
            else:  # every input skipped (or none assigned): nothing to index, no index.json
                log.warning(
                    "ingest: no sample was written to %s; no index.json (see the skipped inputs)", self.out
                )
        trainer.strategy.barrier("ingest_indexed")

    def summary(self) -> dict[str, Any]:
        """This rank's counts: written, skipped by reason, hours of video, seconds, samples/s."""
        seconds = time.perf_counter() - self._t0
        return {
            "rank": self._rank,
            "written": self.written,
            "skipped": dict(self.skipped),
            "video_hours": self.video_seconds / 3600,
            "seconds": seconds,
            "samples_per_s": self.written / seconds if seconds > 0 else 0.0,
        }


def write_index(out: str | os.PathLike, metadata: dict[str, Any] | None = None):
    """Index every complete shard in ``out`` (headers only) and save ``<out>/index.json``; returns it.

    ``metadata`` is stored in the index's ``metadata`` (e.g. ``{"demo": ...}`` for demo shards). The
    writers' own indexes (``.index-r<rank>a<attempt>.json``, one per rank and run) are then removed:
    ``index.json`` holds their shards, and a rerun rebuilds it from the shards themselves. Call it when no
    writer is open (``ShardPredictionWriter`` calls it on rank 0 after every rank has closed its writer).

    The inputs skipped by this and earlier runs are counted in its ``metadata["ingest_skipped"]``
    (reason -> count; the records are in ``ingest-skipped-r<rank>.jsonl``).
    """
    from lightning_adaptiveload.shards.index import ShardIndex

    out = os.fspath(out)
    index = ShardIndex.build(_complete_shards(out), progress=False, patch_size=None, check_values=False)
    # Every sample was checked finite by ShardWriter when it was written.
    index.values_checked = True
    index.metadata = dict(metadata or {})
    done = {k for s in index.shards for k in s.keys}
    counts: dict[str, int] = {}
    for key, rec in skipped_inputs(out).items():
        if key not in done:  # skipped once, written by a later retry: not a skip any more
            counts[rec["error"]] = counts.get(rec["error"], 0) + 1
    if counts:
        index.metadata["ingest_skipped"] = dict(sorted(counts.items()))
    index.save(os.path.join(out, "index.json"))
    for name in os.listdir(out):
        if _WRITER_INDEX.fullmatch(name):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out, name))
    return index


def ingest(
    inputs: str | os.PathLike | Sequence[IngestItem],
    out: str | os.PathLike,
    vae,
    *,
    text_encoder=None,
    tokenizer=None,
    settings: IngestSettings | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    callbacks: Iterable[pl.Callback] = (),
    progress: bool = True,
    limits: DecodeLimits | None = None,
) -> dict[str, Any]:
    """Encode videos and images into latent shards under ``out`` with ``Trainer.predict``.

    Args:
        inputs: a folder (see :func:`find_inputs`), a CSV/JSONL manifest (:func:`read_manifest`) or items.
        out: output folder; a rerun into it skips the inputs already in complete shards.
        vae: folder of a diffusers ``AutoencoderKLWan`` (or the model), or ``"tiny-random"``: a random-weight
            tiny VAE (:mod:`~lightning_adaptiveload.ingest.demo`) to try the pipeline on a CPU without
            downloads. Its shards are DEMO DATA, NOT FOR TRAINING: ``index.json``'s ``metadata["demo"]``
            and each sample's ``demo: true`` say so, a warning is logged, and a folder of demo shards is
            never mixed with real ones (a :class:`FileExistsError` names the folder). Pass small
            ``buckets`` and ``max_frames`` with it (``demo.DEMO_BUCKETS``, ``demo.DEMO_MAX_FRAMES``).
        text_encoder, tokenizer: umT5 encoder and tokenizer folders (or objects); None: no ``text.npy``
            (captions are then kept only in each sample's ``.json``). ``text_encoder="tiny-random"``: a
            random-weight tiny umT5 with its own tokenizer (demo data, as above).
        settings: frame rate, frames, buckets, shard size, dtypes, error policy and decode workers (an
            :class:`~lightning_adaptiveload.ingest.settings.IngestSettings`; its fields are documented
            there); None: its defaults.
        trainer_kwargs: for ``lightning.Trainer`` (``accelerator``, ``devices``, ``num_nodes``, ``strategy``).
        callbacks: more callbacks for the Trainer.
        progress: show the progress bar on rank 0.
        limits: caps on what one input may make the decoder allocate (:class:`DecodeLimits`; default:
            its defaults). Captions beside files in a folder are read with its ``max_caption_bytes``.

    Returns:
        This rank's summary: ``written``, ``skipped`` (reason -> count), ``video_hours``, ``seconds``,
        ``samples_per_s``, plus ``already_done`` (inputs skipped because they were written before),
        ``already_skipped`` (inputs an earlier run skipped, not tried again) and ``assigned`` (inputs this
        rank was given).

    Raises:
        ValueError: a manifest or item list that cannot be used (naming the file, line and rule).
    """
    import importlib.util

    cfg = IngestSettings() if settings is None else settings
    for module, package in (("av", "av"), ("PIL", "pillow"), ("diffusers", "diffusers")):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"ingest needs {package!r}, which is not installed; pip install 'lightning-adaptiveload[ingest]'"
            )
    from lightning_adaptiveload.shards.untrusted import key_problem

    limits = DecodeLimits() if limits is None else limits
    out = os.path.abspath(os.fspath(out))
    if isinstance(inputs, (str, os.PathLike)):
        src = os.fspath(inputs)
        if os.path.isdir(src):
            items = find_inputs(src, limits.max_caption_bytes)
            no_inputs = (
                f"ingest: no videos or images found under {src} (looked for "
                f"{', '.join(VIDEO_EXTENSIONS + IMAGE_EXTENSIONS)}, in subfolders too)"
            )
        else:
            items = read_manifest(src, limits.max_caption_bytes)
            no_inputs = f"ingest: the manifest {src} lists no inputs"
    else:
        items = list(inputs)
        no_inputs = "ingest: the list of inputs is empty"
    for it in items:
        rule = key_problem(it.key)
        if rule is not None:  # refused now, not at the first shard write
            raise ValueError(f"ingest: input {it.path}: key {it.key!r} {rule}")
    keys = [it.key for it in items]
    if len(set(keys)) != len(keys):
        raise ValueError("ingest: input keys are not unique; give each manifest row its own key")
    bucket_list = parse_buckets(cfg.buckets)  # checked by IngestSettings
    for what, value, expected in (
        ("vae", vae, "a diffusers AutoencoderKLWan, e.g. <Wan2.1-T2V-1.3B-Diffusers>/vae"),
        (
            "text_encoder",
            text_encoder,
            "a transformers UMT5EncoderModel, e.g. <Wan2.1-T2V-1.3B-Diffusers>/text_encoder",
        ),
        ("tokenizer", tokenizer, "its tokenizer, e.g. <Wan2.1-T2V-1.3B-Diffusers>/tokenizer"),
    ):
        if isinstance(value, (str, os.PathLike)) and not is_demo_encoder(value) and not os.path.isdir(value):
            raise FileNotFoundError(
                f"ingest: {what} {os.fspath(value)!r} is not a folder; pass the folder of {expected} "
                f"(docs/ingest.md says how to download it), or {DEMO_ENCODER!r} for a random-weight stand-in "
                "to try the pipeline (demo data, not for training)"
            )
    if not items:  # after the encoders' checks: a wrong --vae is named first
        raise ValueError(no_inputs)
    demo = is_demo_encoder(vae) or is_demo_encoder(text_encoder)
    _check_demo_folder(out, demo)
    metadata: dict[str, Any] = {}
    if demo:
        os.makedirs(out, exist_ok=True)
        metadata["demo"] = {
            "note": DEMO_NOTE,
            "vae": DEMO_ENCODER if is_demo_encoder(vae) else _describe_source(vae),
            "text_encoder": DEMO_ENCODER if is_demo_encoder(text_encoder) else _describe_source(text_encoder),
        }
        with open(os.path.join(out, DEMO_MARKER), "w", encoding="utf-8") as f:
            json.dump(metadata["demo"], f, indent=1)
        _warn_demo(out)
    kwargs = dict(
        accelerator="auto",
        devices="auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    kwargs.update(trainer_kwargs or {})
    writer = ShardPredictionWriter(
        out, cfg.samples_per_shard, cfg.latent_dtype, cfg.on_error, progress, metadata
    )
    trainer = pl.Trainer(callbacks=[writer, *callbacks], **kwargs)
    module = IngestModule(vae, text_encoder, tokenizer, cfg.dtype)
    module.items, module.out, module.num_workers = items, out, cfg.num_workers
    module.decode_args = (cfg.fps, cfg.max_frames, bucket_list, limits)
    trainer.predict(module, return_predictions=False)
    summary = {
        **writer.summary(),
        "already_done": module.already_done,
        "already_skipped": module.already_skipped,
        "assigned": writer.total,
    }
    return {**summary, "demo": True} if demo else summary


def _describe_source(value: Any) -> str | None:
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value is None else os.fspath(value)
    return type(value).__name__


def _check_demo_folder(out: str, demo: bool) -> None:
    """Refuse to mix shards of the demo encoders and of real ones in one output folder.

    A rerun into a folder resumes it: demo latents (random weights) beside real ones would make one data
    set of two encoders, and nothing downstream could tell them apart by shape.
    """
    has_marker = os.path.exists(os.path.join(out, DEMO_MARKER))
    shards = _complete_shards(out)
    if demo and shards and not has_marker:
        raise FileExistsError(
            f"ingest: {out} already holds {len(shards)} shards encoded with a real VAE; demo shards "
            "(random-weight encoders) must not be mixed into it. Pass another --out folder for the demo."
        )
    if not demo and has_marker:
        raise FileExistsError(
            f"ingest: {out} holds DEMO shards (written with the random-weight tiny encoders, see "
            f"{DEMO_MARKER} there); real shards must not be mixed into it. Pass another --out folder, or "
            "delete this one (it holds nothing worth keeping)."
        )


def _warn_demo(out: str) -> None:
    """The loud warning of a demo ingest (once per node: every rank runs ``ingest``)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    bar = "!" * 100
    log.warning(
        "\n%s\n!! ingest with a RANDOM-WEIGHT demo encoder: the shards in %s are DEMO DATA, NOT FOR TRAINING.\n"
        "!! They have the right shapes and go through every stage, but encode nothing a model can learn.\n"
        "!! index.json's metadata says 'demo'. For real data pass Wan's VAE (docs/ingest.md).\n%s",
        bar,
        out,
        bar,
    )

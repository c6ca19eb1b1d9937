"""`lightning-adaptiveload ingest`: videos and images to latent shards."""

from lightning_adaptiveload.cli.main import ingest_main as main

__all__ = ["main"]

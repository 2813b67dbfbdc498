"""Working with checkpoints outside a training run: inspect, export, import, upload, prune.

The functions here back the ``tiercheck`` subcommands of the same names (`tools.cli`)
and can be called from Python; none of them starts a thread or changes a step it reads.
"""

from __future__ import annotations

from .describe import describe_step
from .export import ExportResult, export_step
from .ingest import ImportResult, import_step
from .prune import PruneResult, prune_steps, remove_step
from .upload import UploadResult, upload_steps

FLOOR = 9

__all__ = [
    "ExportResult",
    "ImportResult",
    "PruneResult",
    "UploadResult",
    "describe_step",
    "export_step",
    "import_step",
    "prune_steps",
    "remove_step",
    "upload_steps",
]

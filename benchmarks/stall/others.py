"""The saves the stall benchmark times, part 2: torch.save, DCP's blocking and asynchronous
modes, torchsnapshot (each with its best options on this machine)."""

from __future__ import annotations

import contextlib
import os

import torch

from benchmarks.common import fsync_tree
from benchmarks.stall.methods import Method, Pending, Unavailable, rm


class TorchSave(Method):
    name = "torch_save"
    description = "torch.save of the state dicts + flush + fsync (blocking)"

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh("torch_save.pt")
        with open(path, "wb") as f:
            torch.save(self.ctx.state_dicts(), f)
            f.flush()
            os.fsync(f.fileno())
        return Pending(None, cleanup=rm(path))


class DCPSave(Method):
    name = "dcp_save"
    description = "torch.distributed.checkpoint.save (blocking; FileSystemWriter fsyncs)"

    def setup(self) -> None:
        try:
            import torch.distributed.checkpoint as dcp
        except ImportError as e:
            raise Unavailable(f"torch.distributed.checkpoint: {e}") from e
        self.dcp = dcp

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh("dcp_save")
        self.dcp.save(self.ctx.state_dicts(), checkpoint_id=str(path))
        return Pending(None, cleanup=rm(path))


class DCPAsync(Method):
    process = False
    async_staging = True
    shared_memory = False

    def setup(self) -> None:
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        except ImportError as e:
            raise Unavailable(f"DCP async pieces missing in torch {torch.__version__}: {e}") from e
        self.dcp = dcp
        self.kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        if self.process:
            self.ctx.ensure_process_group()
        cuda = self.ctx.device.type == "cuda"
        # Best options the installed torch offers: pinned memory and non-blocking copies need
        # an accelerator; shared memory is what the PROCESS executor needs to skip a copy.
        self.options = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=self.shared_memory,
            use_async_staging=self.async_staging,
            use_non_blocking_copy=cuda,
        )
        self.stager = DefaultStager(self.options)  # reused: its staging buffers are cached

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh(self.name)
        r = self.dcp.async_save(
            self.ctx.state_dicts(),
            checkpoint_id=str(path),
            async_checkpointer_type=self.kind,
            async_stager=self.stager,
        )
        staging = getattr(r, "staging_completion", None)
        upload = getattr(r, "upload_completion", r)
        before = None if staging is None else staging.result
        return Pending(upload.result, before_step=before, cleanup=rm(path))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stager.close()


class DCPAsyncThread(DCPAsync):
    name = "dcp_async_thread"
    description = "dcp.async_save, THREAD executor, reused DefaultStager (async staging)"


class DCPAsyncThreadSync(DCPAsync):
    name = "dcp_async_thread_sync"
    description = "dcp.async_save, THREAD executor, reused DefaultStager (staging before return)"
    async_staging = False


class DCPAsyncProcess(DCPAsync):
    name = "dcp_async_process"
    description = "dcp.async_save, PROCESS executor, reused DefaultStager (shared memory, async staging)"
    process = True
    shared_memory = True


class TorchSnapshot(Method):
    name = "torchsnapshot"
    description = "torchsnapshot Snapshot.async_take, wait(), fsync of its files (it never fsyncs)"

    def setup(self) -> None:
        try:
            from torchsnapshot import Snapshot
        except Exception as e:  # ImportError, or a broken install against this torch
            raise Unavailable(f"torchsnapshot does not import: {type(e).__name__}: {e}") from e
        self.Snapshot = Snapshot

    def save(self, step: int) -> Pending:
        path = self.ctx.fresh("torchsnapshot")
        pending = self.Snapshot.async_take(
            path=str(path), app_state={"model": self.ctx.w.model, "optim": self.ctx.w.optimizer}
        )

        def wait() -> None:
            pending.wait()
            fsync_tree(path)

        return Pending(wait, cleanup=rm(path))

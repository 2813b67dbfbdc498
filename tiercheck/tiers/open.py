"""The one place tiers are built: `open_tier` turns a location (or a `Tier` given as is) into
a tier; `open_default_tier` does so with Checkpointer's defaults for the tools."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidArgumentError
from ..observe.events import logger
from .base import Tier
from .local import LocalTier
from .memory import SharedMemoryTier, check_memory_dir, clean_jobs, job_identity
from .remote import RemoteTier
from .retry import RetryPolicy

ROLES = ("local", "remote")
REMOTE_TIMEOUT = 30.0  # Checkpointer(remote_timeout=) default, seconds per object-store call
REMOTE_RETRY_BUDGET = 120.0  # Checkpointer(remote_retry_budget=) default, seconds


def open_tier(
    location: str | os.PathLike[str] | Tier,
    *,
    role: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> Tier:
    """The tier at `location`, for the role it plays.

    Args:
        location: a `Tier`, returned as it is (it keeps the options it was built with), or
            a location: a local directory, a ``file://`` URL, or any fsspec URL.
        role: "local" (tier 1): a directory or ``file://`` URL, as a `LocalTier`; another URL
            is refused. "remote" (tier 2): any location as a `RemoteTier`; a plain path is
            the local filesystem, as ``file://`` is. None (readers: `tiercheck.load`, the
            CLI): a URL is a `RemoteTier`, a plain path a `LocalTier`.
        storage_options: fsspec options for a `RemoteTier` (ignored for a directory).
        options: keyword arguments of the tier's constructor (``direct_io``, ``fsync``,
            ``write_rate`` for a `LocalTier`; ``retry``, ``op_timeout``, ``compression``,
            ``concurrency``, ``block_size``, ``write_rate`` for a `RemoteTier`).

    Returns:
        A tier whose `name` is `role` (for role None: "local" for a directory, else "remote").

    Raises:
        InvalidArgumentError: a `Tier` whose name is not `role`, a `Tier` together with
            `storage_options` or `options` (they are the tier's own, set when it was built),
            an unknown role or option, or a URL other than ``file://`` as a local tier.

    Example:
        >>> open_tier("ckpt/run7", role="local", fsync=False)    # doctest: +SKIP
        >>> open_tier("s3://bucket/run7", role="remote")         # doctest: +SKIP
    """
    if role is not None and role not in ROLES:
        raise InvalidArgumentError(f"role must be one of {ROLES} or None, got {role!r}")
    if isinstance(location, Tier):
        return _given(location, role, storage_options, options)
    loc = os.fspath(location)
    is_url = "://" in loc or "::" in loc
    if role == "local" or (role is None and not is_url):
        if loc.startswith("file://"):
            loc = loc[len("file://") :]
        elif is_url:
            raise InvalidArgumentError(
                f"local= takes a directory (or a file:// URL), got {loc!r}; give an object-store URL as remote="
            )
        try:
            return LocalTier(loc, name=role or "local", **options)
        except TypeError as exc:  # an option a local tier does not take
            raise InvalidArgumentError(f"cannot open {loc!r} as a local tier: {exc}") from exc
    try:
        return RemoteTier(loc, storage_options, name=role or "remote", **options)
    except TypeError as exc:
        raise InvalidArgumentError(f"cannot open {loc!r} as a remote tier: {exc}") from exc


def _given(tier: Tier, role: str | None, storage_options: Mapping[str, Any] | None, options: dict[str, Any]) -> Tier:
    if role is not None and tier.name != role:
        raise InvalidArgumentError(
            f"a tier given as {role}= must be named {role!r}, got a {type(tier).__name__} named {tier.name!r} "
            f"at {tier.location}; build it with name={role!r}"
        )
    given = sorted(options) + (["storage_options"] if storage_options else [])
    if given:
        raise InvalidArgumentError(
            f"{', '.join(given)} cannot be applied to the {type(tier).__name__} given for {tier.location}: "
            "a Tier passed in keeps the options it was built with; set them when building it"
        )
    return tier


def with_timeouts(url: str, options: Mapping[str, Any] | None, timeout: float) -> dict[str, Any]:
    """Bound S3 client calls: botocore's defaults (60 s reads, retries inside) stall for minutes."""
    opts = dict(options or {})
    if url.startswith(("s3://", "s3a://")):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        config.setdefault("retries", {"max_attempts": 2, "mode": "standard"})
        opts["config_kwargs"] = config
    return opts


def open_default_tier(location: str, storage_options: Mapping[str, Any] | None = None) -> Tier:
    """The tier at `location` (a directory or URL) with Checkpointer's default settings, for
    tools that write steps outside a Checkpointer (``tiercheck import``)."""
    if "://" not in location:
        return open_tier(location, role="local")
    return open_tier(
        location,
        role="remote",
        storage_options=with_timeouts(location, storage_options, REMOTE_TIMEOUT),
        retry=RetryPolicy(budget_s=REMOTE_RETRY_BUDGET),
        op_timeout=REMOTE_TIMEOUT,
    )


def open_memory_tier(
    memory_dir: str, job_id: str | None, local: Tier | None, remote: Tier | None, rank: int, ttl: float
) -> SharedMemoryTier | None:
    """Tier 0 of this job on this node (`tiers.memory`), or None with one warning when
    `memory_dir` cannot hold it. At start-up it removes what jobs that never came back left
    there, once untouched for `ttl` seconds (never a live job's files, never this job's)."""
    why = check_memory_dir(memory_dir)
    if why is not None:
        logger.warning("tiercheck: tier 0 (memory) is off: %s; saves go on to the other tiers", why)
        return None
    local_dir = local.local_dir() if local is not None and local.capabilities.local_files else None
    ident, source = job_identity(job_id, local_dir, None if remote is None else remote.location)
    tier = SharedMemoryTier(memory_dir, ident, source, rank=rank)
    try:
        for job in clean_jobs(memory_dir, ttl, keep=tier.root):
            logger.info("tiercheck: removed %s (job %s, untouched for over %.0f s)", job.root, job.job_id, ttl)
    except OSError as exc:
        logger.warning("tiercheck: could not clean old tier-0 files in %s: %r", memory_dir, exc)
    return tier

"""Real test servers (no mocks) for tiercheck's remote tier: SeaweedFS (S3), Azurite (Azure
Blob), gcp-storage-emulator (GCS), a TCP fault proxy and a TCP shaping proxy (a per-connection
bandwidth cap and an added round trip: a network to measure on). Fixtures live in ``tests.helpers.servers.plugin``.

Importing this package sets GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (gcsfs reads it on import).
"""

from __future__ import annotations

from .azurite import Azurite
from .faultproxy import FaultProxy, ProxiedServer, proxied
from .gcs import GCSEmulator
from .ports import free_port, free_ports
from .process import ManagedProcess, ObjectStoreServer, ServerStartError
from .seaweedfs import SeaweedFS
from .shapingproxy import ShapingProxy, ShapingProxyProcess

__all__ = [
    "Azurite",
    "FaultProxy",
    "GCSEmulator",
    "ManagedProcess",
    "ObjectStoreServer",
    "ProxiedServer",
    "SeaweedFS",
    "ServerStartError",
    "ShapingProxy",
    "ShapingProxyProcess",
    "free_port",
    "free_ports",
    "proxied",
]

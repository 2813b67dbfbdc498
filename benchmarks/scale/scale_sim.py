"""A model (not a measurement) of tiercheck's multi-rank commit protocol at scale.

    .venv/bin/python benchmarks/scale/scale_sim.py --quick
    .venv/bin/python benchmarks/scale/scale_sim.py --ranks 8,64,1k,10k,20k --json out.json

For each world size W it estimates, against an object store and the job's key-value
store (a torch TCPStore: one server thread, which every rank talks to):

* the commit of one step on the shared object-store tier (tier 2) and on a node-local
  tier 1: requests to the object store, store operations (polls counted apart), the
  bytes the store sends (rank 0 fetches every report; only the leaders fetch the
  `marker` key, every other rank a two-byte `verdict`), the commit marker's size, and the
  latency the protocol adds after the slowest rank's part is durable (until COMMIT is
  visible, until every rank knows it, until the last rank's `_commit` returns, which
  includes deleting the step's shared keys);
* restore discovery: agreeing on the candidate steps (rank 0 lists tier 2 once; each
  rank deletes its own `have/<rank>` once it has the plan) and reading the first
  candidate's COMMIT and manifest from tier 2; the store operations of a whole restore
  of the newest step, the clean-up included (every rank adds to `ack`, the last deletes
  `n`, `plan`, `ack` and four keys per candidate tried, one by one: 7 deletes, however
  many steps tier 2 holds); and the cost of a candidate that some rank cannot read
  (failing ranks count themselves in `r<i>/bad`, the first three append their reason to
  `r<i>/why`, and the last rank deletes the candidate's four keys at the end);
* replicated keys with a node-local tier 1 and a tier 2 (closed form, per node): every
  node writes its own copy to tier 1, rank 0's node uploads the one copy tier 2 gets,
  and a restore from tier 1 reads nothing from tier 2;
* designs tiercheck does not use, for comparison: every rank lists the bucket at
  restore, every rank polls the store with no backoff, a commit that "renames" a
  temporary prefix (an object store can only copy and delete);
* which resource saturates first, and at which W.

The commit phase is a small discrete-event simulation (deterministic: seeded) of every
rank's store operations in the order `tiercheck/coordination.py` and
`tiercheck/pipeline.py` issue them: the store serves one request at a time (FIFO) and
sends payloads over one egress link (FIFO; replies under 4 KiB are not held behind
payloads); each rank has one request in flight; polls back off 2 ms, 4 ms, ... up to
50 ms x max(1, W/1000), at most 1 s (`Coordinator._poll_max`).
Everything else is closed-form: request counts follow `tiers/remote.py` and s3fs
(multipart upload in 16 MiB parts, one recursive listing paginated 1000 keys per
request, ranged GETs of 64 MiB), the polling load before the last part is durable
comes from mean-value analysis of a closed queue (W clients thinking one poll interval).

Every number depends on the assumptions printed with the output (change them with the
options below). Treat the results as orders of magnitude and as a way to see which
term grows fastest, not as predictions for a particular cluster or bucket.

It imports the protocol's constants from tiercheck (so the package must import); `--plot PATH`
uses matplotlib if installed.

The model lives in four modules beside this one: model.py (assumptions, sizes, request
counts, queueing), commit.py (the commit simulation, one world size), closed.py (restore,
rename, replicated keys, saturation), render.py (tables).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: `benchmarks.*` when run as a script

from benchmarks.scale.closed import crossing_points
from benchmarks.scale.commit import run_world
from benchmarks.scale.model import Assumptions
from benchmarks.scale.render import plot, render


def _parse_ranks(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1000 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    if any(w < 2 for w in out):
        raise argparse.ArgumentTypeError("world sizes must be at least 2")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=_parse_ranks, default=_parse_ranks("8,64,1k,10k"), help="world sizes (8,64,1k,10k)")
    p.add_argument("--quick", action="store_true", help="one seeded run per world size (a few seconds)")
    p.add_argument("--seeds", type=int, default=5, help="seeded runs per world size without --quick (median)")
    p.add_argument("--json", metavar="PATH", help="also write the results and assumptions as JSON")
    p.add_argument("--plot", metavar="PATH", help="PNG of the modelled latencies (needs matplotlib)")
    for f in dataclasses.fields(Assumptions):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(f.default),
            default=f.default,
            metavar="X",
            help=f"(default {f.default}; see Assumptions)",
        )
    args = p.parse_args(argv)
    a = Assumptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Assumptions)})
    seeds = [1] if args.quick else list(range(1, args.seeds + 1))
    t0 = time.perf_counter()
    results = [run_world(w, a, seeds) for w in args.ranks]
    crossings = crossing_points(a)
    sys.stdout.write(render(results, a, crossings, len(seeds)))
    print(f"\n(model computed in {time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json:

        def plain(o: Any) -> Any:
            if dataclasses.is_dataclass(o) and not isinstance(o, type):
                return dataclasses.asdict(o)
            raise TypeError(type(o).__name__)

        doc = {
            "kind": "model, not a measurement",
            "assumptions": dataclasses.asdict(a),
            "seeds": seeds,
            "results": results,
            "crossings": crossings,
        }
        with open(args.json, "w") as out:
            json.dump(doc, out, indent=1, default=plain)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

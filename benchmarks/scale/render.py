"""The multi-rank model's report: markdown tables and an optional plot."""

from __future__ import annotations

import sys
from typing import Any

from benchmarks.scale.model import REASONS_KEPT, VERDICT_OK, Assumptions
from tiercheck.steps.catalog import MAX_MARKER_BYTES  # a larger COMMIT is rejected as corrupted

# ------------------------------------------------------------------- output


def _fmt_s(s: float) -> str:
    if s >= 100:
        return f"{s:.0f} s"
    if s >= 1:
        return f"{s:.1f} s"
    return f"{s * 1e3:.0f} ms" if s >= 0.001 else f"{s * 1e3:.2f} ms"


def _fmt_n(n: float) -> str:
    if n >= 1e7:
        return f"{n / 1e6:.0f}M"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e4:
        return f"{n / 1e3:.0f}k"
    return f"{n:,.0f}"


def _fmt_ratio(x: float) -> str:
    if x < 0.01:
        return "<0.01"
    return f"{x:.2f}" if x < 10 else f"{x:,.0f}"


def _fmt_b(b: float) -> str:
    if b >= 1e12:
        return f"{b / 1e12:.1f} TB"
    if b >= 1e9:
        return f"{b / 1e9:.1f} GB"
    if b >= 1e6:
        return f"{b / 1e6:.2f} MB"
    if b >= 1e3:
        return f"{b / 1e3:.1f} kB"
    return f"{b:.0f} B"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(results: list[dict[str, Any]], a: Assumptions, crossings: dict[str, int | None], seeds: int) -> str:
    out = [
        "### tiercheck multi-rank protocol: a model, not a measurement",
        "",
        f"benchmarks/scale/scale_sim.py; median of {seeds} seeded run(s). Assumptions:",
        "",
        *[f"- {line}" for line in a.describe()],
        "",
        "#### Commit of one step on the object-store tier (tier 2, rank 0 writes COMMIT)",
        "",
        "Latencies count from the moment the slowest rank's shard and manifest are durable. The upload window "
        "covers the per-rank shards; the replicated keys lengthen the uploads of rank 0's node (next tables).",
        "",
    ]
    rows = []
    for r in results:
        c = r["commit_shared"]
        rows.append(
            [
                _fmt_n(r["W"]),
                f"{_fmt_n(r['obj_requests_total'])} / {_fmt_n(r['obj_requests_rank0'])}",
                f"{_fmt_s(r['upload_s'])}" + (f" (x{r['put_throttle']:.1f})" if r["put_throttle"] > 1.05 else ""),
                _fmt_b(r["marker_bytes"])
                + (f" **over {MAX_MARKER_BYTES >> 20} MiB**" if r["marker_over_limit"] else ""),
                f"{_fmt_n(r['store_ops_shared'])} + {_fmt_n(r['store_polls_shared'])}",
                f"{_fmt_b(r['store_sent_shared'])} ({VERDICT_OK} B)",
                f"{_fmt_n(r['store_rate_backoff'])}/s ({r['store_rate_backoff'] / a.store_ops:.0%})",
                _fmt_s(c["visible_s"]),
                _fmt_s(c["known_s"]),
                _fmt_s(c["returned_s"]),
            ]
        )
    out.append(
        _table(
            [
                "W",
                "object-store requests/step: all / rank 0",
                "upload window (PUT-rate stretch)",
                "COMMIT size",
                "store ops/step + polls",
                "store bytes sent/step (a non-leader's get)",
                "store load while waiting",
                "+COMMIT visible",
                "+every rank knows",
                "+last _commit returns",
            ],
            rows,
        )
    )
    out += [
        "",
        f"Rank 0's requests include retention (keep_remote={a.keep_remote}): two listings of the root and the "
        "deletion of one step. Store ops: non-poll operations (formula) + polls (simulated after the slowest "
        "part is durable, closed form before). Store bytes: payload the store sends, mostly the W reports rank 0 "
        "fetches (rank 0, the only leader, never fetches the marker); in brackets what one non-leader's get "
        "of the verdict carries. 'Store load': polls per second while ranks wait for the slowest part, as a share "
        "of the store's capacity.",
        "",
        "#### Commit on a node-local tier 1 (one leader per node writes COMMIT)",
        "",
    ]
    rows = []
    for r in results:
        c = r["commit_local"]
        rows.append(
            [
                _fmt_n(r["W"]),
                _fmt_n(r["leaders_local"]),
                f"{_fmt_n(r['store_ops_local'])} + {_fmt_n(r['commit_local']['polls'])}",
                f"{_fmt_b(r['store_sent_local'])} ({_fmt_b(r['marker_bytes'])} / {VERDICT_OK} B)",
                _fmt_s(c["visible_s"]),
                _fmt_s(c["known_s"]),
                _fmt_s(c["returned_s"]),
                _fmt_s(c["link_s"]),
            ]
        )
    out.append(
        _table(
            [
                "W",
                "leaders",
                "store ops/step + polls after the slowest part",
                "store bytes sent/step (a leader's / a non-leader's get)",
                "+last marker written",
                "+every rank knows",
                "+last _commit returns",
                "store link time (marker to the other leaders)",
            ],
            rows,
        )
    )
    out += [
        "",
        "#### Replicated keys with a node-local tier 1 and a tier 2 (per node, per step)",
        "",
    ]
    rows = []
    for r in results:
        x = r["replicated"]
        other = _fmt_b(x["tier2_other_bytes"]) if x["nodes"] > 1 else "-"
        rows.append(
            [
                _fmt_n(r["W"]),
                _fmt_n(x["nodes"]),
                _fmt_b(x["tier1_node_bytes"]),
                f"+{_fmt_s(x['tier1_replicated_s'])}",
                f"{_fmt_b(x['tier2_node0_bytes'])} / {other}",
                f"{x['uploaders']}: {_fmt_s(x['upload_busiest_s'])} vs {_fmt_s(x['upload_plain_s'])}; "
                f"+{_fmt_n(x['extra_put_requests'])} PUT",
                f"0 B; {_fmt_b(x['restore_node_disk_bytes'])} from each node's disk, "
                f"{_fmt_s(x['restore_node_disk_s'])}",
            ]
        )
    out.append(
        _table(
            [
                "W",
                "nodes",
                "tier-1 bytes written per node",
                "a node's disk, for its copy of the keys",
                "tier-2 bytes uploaded: rank 0's node / another",
                "ranks uploading the keys: busiest upload vs a rank's own state only",
                "restore from tier 1: bytes from tier 2; from disk",
            ],
            rows,
        )
    )
    out += [
        "",
        f"{a.replicated_mib:g} MiB of replicated keys in {a.replicated_keys} equal keys, {a.gpus_per_node} ranks and "
        "one tier-1 directory per node. Every node now writes its own copy to tier 1; tier 2 still gets one copy, "
        "all of it from rank 0's node, whose uplink carries it.",
        "",
        "#### Restore discovery from tier 2 (fresh nodes)",
        "",
    ]
    rows = []
    for r in results:
        x = r["restore"]
        k, acc = x["kept"], x["accumulated"]
        rows.append(
            [
                _fmt_n(r["W"]),
                f"{_fmt_n(k['list_requests'])} ({_fmt_s(k['listing_s'])})",
                _fmt_s(k["discovery_s"]),
                f"{_fmt_n(k['restore_ops'])} ({_fmt_n(k['cleanup_deletes'])} deletes, {_fmt_s(k['cleanup_s'])})",
                f"{_fmt_n(acc['list_requests'])} ({_fmt_s(acc['listing_s'])})"
                + (" **> remote_timeout: fails**" if acc["listing_fails"] else ""),
                _fmt_n(x["max_steps_listable"]),
                f"{_fmt_n(x['meta_get_requests'])}, {_fmt_b(x['marker_download_total_mb'] * 1e6)} of COMMIT",
                f"{_fmt_n(x['data_get_requests'])} ({_fmt_s(x['data_s'])})",
                f"{_fmt_n(x['failed_one']['ops'])} ops, {_fmt_b(x['failed_one']['bytes'])} "
                f"({_fmt_s(x['failed_one']['s'])})",
                f"{_fmt_n(x['failed_all']['ops'])} ops, {_fmt_b(x['failed_all']['bytes'])} "
                f"({_fmt_s(x['failed_all']['s'])})",
            ]
        )
    out.append(
        _table(
            [
                "W",
                f"rank 0 LIST requests, {a.keep_remote} steps kept",
                "discovery (plan + COMMIT/manifest reads)",
                "store ops, restore of the newest step (clean-up: the last rank's deletes; time from the acks)",
                f"LIST requests, {a.accumulated} steps (keep_remote=None)",
                "steps listable within remote_timeout",
                "GET/HEAD for COMMIT, manifest, shard size",
                "ranged GETs for the shards",
                "a candidate one rank fails: store ops, bytes sent (time)",
                "a candidate every rank fails: store ops, bytes sent (time)",
            ],
            rows,
        )
    )
    out += [
        "",
        "Store ops of a restore (polls not counted): the plan (each rank sets `have/<rank>`, adds to `n`, gets "
        "`plan` and deletes its `have/<rank>`; rank 0 fetches the lists and sets `plan`), one round every rank "
        "passes (`add r<i>/n`, read `r<i>/bad`), and the clean-up: every rank adds to `ack`, the last deletes "
        "`n`, `plan`, `ack` and 4 keys for each candidate tried (here the first, the newest step), one by one: "
        f"{results[0]['restore']['kept']['cleanup_deletes']} deletes, with {a.keep_remote} steps on tier 2 as with "
        f"{a.accumulated}. "
        "Failed candidate: each failing rank adds to `r<i>/bad` and the first "
        f"{REASONS_KEPT} append a line to `r<i>/why`; then every rank adds to `r<i>/n`, reads `r<i>/bad`, gets "
        f"`r<i>/why` (at most {REASONS_KEPT} lines) and reads `r<i>/fatal`, and at the end the last rank deletes "
        f"the candidate's 4 keys; reasons of {a.reason_chars} characters; no rank gives up (each that does adds "
        "one `add r<i>/fatal`).",
        "",
        "#### Designs tiercheck avoids (same assumptions)",
        "",
    ]
    rows = []
    for r in results:
        x, c, nb, rn = r["restore"]["kept"], r["commit_shared"], r["commit_nobackoff"], r["rename"]
        rows.append(
            [
                _fmt_n(r["W"]),
                f"{_fmt_n(x['every_rank_list_requests'])} LIST, {_fmt_s(x['every_rank_list_s'])} "
                f"(vs {_fmt_n(x['list_requests'])}, {_fmt_s(x['listing_s'])})",
                f"{_fmt_n(r['store_polls_nobackoff'])} polls, {_fmt_n(r['store_rate_nobackoff'])}/s, "
                f"{r['store_resp_nobackoff_ms']:.2f} ms/op (vs {_fmt_n(r['store_polls_shared'])}, "
                f"{_fmt_n(r['store_rate_backoff'])}/s, {r['store_resp_backoff_ms']:.2f} ms)",
                f"{_fmt_s(nb['known_s'])} (vs {_fmt_s(c['known_s'])})",
                f"{_fmt_n(rn['requests'])} req, +{_fmt_s(rn['added_s'])}, {_fmt_b(rn['bytes_copied_gb'] * 1e9)} copied",
            ]
        )
    out.append(
        _table(
            [
                "W",
                "restore: every rank lists tier 2",
                "commit, polls with no backoff: polls/step, store rate, queueing per op (vs backoff)",
                "+every rank knows, no backoff",
                "commit by copy-and-delete 'rename'",
            ],
            rows,
        )
    )
    out += [
        "",
        "#### What saturates first",
        "",
        "Demand over capacity at each W (closed form, mean values); at 1 or more the resource is saturated or the "
        "limit crossed. Rows marked '>1 s' compare a delay with 1 s, an arbitrary threshold. L: leaders "
        f"({a.gpus_per_node} ranks per node). [avoided design]: what tiercheck never did.",
        "",
    ]
    rows = []
    for name, w in sorted(crossings.items(), key=lambda kv: (kv[1] is None, kv[1] or 0)):
        cells = [_fmt_ratio(r["ratios"][name]) for r in results]
        cells = [f"**{c}**" if r["ratios"][name] >= 1 else c for c, r in zip(cells, results, strict=True)]
        rows.append([name, "never (up to 2^20)" if w is None else f"{w:,}", *cells])
    out.append(_table(["resource", "from W =", *[f"W={_fmt_n(r['W'])}" for r in results]], rows))
    return "\n".join(out) + "\n"


def plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    ws = [r["W"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (
        ("commit_shared", "tier 2: every rank knows"),
        ("commit_local", "node-local tier 1: every rank knows"),
        ("commit_nobackoff", "tier 2, polling without backoff"),
    ):
        ax.plot(ws, [r[key]["known_s"] for r in results], marker="o", label=label)
    ax.plot(ws, [r["restore"]["kept"]["discovery_s"] for r in results], marker="s", label="restore discovery")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("ranks (W)")
    ax.set_ylabel("seconds (model)")
    ax.set_title("tiercheck multi-rank protocol: modelled latency")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)

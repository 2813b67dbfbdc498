"""The pure decisions, tested as values: no Checkpointer, no thread, no tier."""

from __future__ import annotations

import pytest
import torch

from tiercheck.errors import InvalidArgumentError, StepConflictError, UnsupportedStateError
from tiercheck.format.checksum import checksum_function, checksum_stream, feed_regions
from tiercheck.format.manifest import decode_manifest, encode_manifest
from tiercheck.options import Options
from tiercheck.plan.placement import JobLayout, key_sizes, normalize_replicated, place, place_state, replicated_keys
from tiercheck.plan.retention import KeepLast
from tiercheck.plan.shards import plan_shard
from tiercheck.plan.stepdoc import shard_manifest, stored_as, with_alias_sums
from tiercheck.plan.steporder import Branch, Proceed, claim
from tiercheck.state.flatten import flatten_state


def state() -> dict[str, object]:
    return {
        "model": {"w": torch.zeros(1000), "b": torch.zeros(10)},  # 4040 bytes
        "optimizer": {"m": torch.zeros(2000)},  # 8000 bytes
        "ema": torch.zeros(500),  # 2000 bytes
        "step": 7,
    }


def test_balance_places_the_largest_key_first_on_the_least_loaded_rank() -> None:
    s = state()
    keys = replicated_keys(s, frozenset({"model", "optimizer", "ema"}))
    assert keys == ["model", "optimizer", "ema"]  # the state's order
    placement = place(keys, lambda: key_sizes(s, keys), JobLayout(2), "balance")
    assert dict(placement.owners) == {"optimizer": 0, "model": 1, "ema": 1}
    assert dict(placement.uploaders) == {}


def test_one_writer_rank_needs_no_sizes() -> None:
    def no_sizes() -> dict[object, int]:
        raise AssertionError("sizes were computed")

    placement = place(["model", "ema"], no_sizes, JobLayout(4), 3)
    assert dict(placement.owners) == {"model": 3, "ema": 3}


def test_node_local_tier1_balances_per_directory_and_uploads_from_rank0s() -> None:
    s = state()
    keys = ["model", "optimizer", "ema"]
    job = JobLayout(4, node_local=True, members=(2, 3), first_members=(0, 1), has_remote=True)
    placement = place(keys, lambda: key_sizes(s, keys), job, 0)  # a writer rank is not used here
    assert dict(placement.owners) == {"optimizer": 2, "model": 3, "ema": 3}
    assert dict(placement.uploaders) == {"optimizer": 0, "model": 1, "ema": 1}


def test_split_state_leaves_replica_references_in_the_state_order() -> None:
    placed = place_state(state(), 1, frozenset({"model", "optimizer"}), JobLayout(2), "balance")
    tree = placed.flat.tree
    assert tree["k"] == [["s", "model"], ["s", "optimizer"], ["s", "ema"], ["s", "step"]]
    assert tree["v"][1] == {"t": "replica", "r": 0}  # optimizer: rank 0 writes it
    assert tree["v"][0]["t"] != "replica"  # model: this rank's own
    assert placed.replicated == (("s", "model"), ("s", "optimizer"))


def test_replicated_arguments_are_checked() -> None:
    assert normalize_replicated(["a", 3]) == frozenset({"a", 3})
    assert normalize_replicated([]) is False
    with pytest.raises(InvalidArgumentError, match="collection of top-level keys"):
        normalize_replicated("model")
    with pytest.raises(UnsupportedStateError, match="not in the state"):
        replicated_keys({"a": 1}, frozenset({"b"}))


def test_claim_proceeds_refuses_or_branches() -> None:
    assert claim(5, 4, [1, 2, 4], None, "where") == Proceed()
    with pytest.raises(StepConflictError, match="step 4 is already committed"):
        claim(4, 4, [1, 2, 4], None, "where")
    # After restoring step 2, saving step 3 abandons the steps after 2.
    assert claim(3, 4, [1, 2, 4], 2, "where") == Branch(2, (4,))
    with pytest.raises(StepConflictError):  # not after the restored step
        claim(2, 4, [1, 2, 4], 2, "where")


def test_the_manifest_builder_is_a_value_of_the_staged_leaves() -> None:
    t = torch.arange(4, dtype=torch.float32)
    flat = flatten_state({"a": t, "b": t, "n": 3})  # b aliases a
    plan = plan_shard(flat.leaves)
    assert [leaf.alias_of for leaf in flat.leaves] == [None, 0]
    sums = with_alias_sums(flat.leaves, ["aaaa", ""])
    assert sums == ["aaaa", "aaaa"]
    m = shard_manifest(
        step=9,
        rank=0,
        world_size=1,
        checksum_algorithm="crc32c",
        leaves=flat.leaves,
        plan=plan,
        sums=sums,
        tree=flat.tree,
    )
    assert (m.step, m.rank, m.world_size) == (9, 0, 1)
    assert m.files[0].length == plan.total_bytes
    assert decode_manifest(encode_manifest(m), "m") == m
    zipped = stored_as(m, "zstd", [123])
    assert (zipped.files[0].codec, zipped.files[0].stored_length) == ("zstd", 123)
    assert stored_as(m, "raw", [123]).files[0].stored_length is None


def test_options_are_validated_once_into_a_frozen_value() -> None:
    import inspect

    import tiercheck

    args = {
        n: p.default for n, p in inspect.signature(tiercheck.Checkpointer.__init__).parameters.items() if n != "self"
    }
    opts = Options.validate(**{**args, "local": "/tmp/x", "keep_local": 3})
    assert opts.retention.keep_local == KeepLast(3)
    assert (opts.job.rank, opts.job.world_size) == (0, 1)
    assert opts.tiers.local == "/tmp/x" and opts.save.checksum == "crc32c"
    with pytest.raises(AttributeError):
        opts.save.checksum = "xxh3_64"  # type: ignore[misc]
    with pytest.raises(InvalidArgumentError, match="upload_backlog"):
        Options.validate(**{**args, "local": "/tmp/x", "upload_backlog": "oldest"})
    with pytest.raises(InvalidArgumentError, match="at least one tier"):
        Options.validate(**args)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16, 64])
def test_feed_regions_hashes_each_region_whole_whatever_the_chunking(chunk: int) -> None:
    # regions with gaps, a zero-length one, and regions longer and shorter than a chunk
    data = bytes(range(256)) * 2
    spans = [(0, 5), (5, 0), (5, 20), (30, 2), (40, 100), (300, 212)]
    regions = [((off, n), checksum_function("crc32c")(data[off : off + n])) for off, n in spans]
    hashers = [checksum_stream("crc32c") for _ in regions]
    first, completed_at = 0, {}
    for pos in range(0, len(data), chunk):
        first, done = feed_regions(regions, hashers, first, pos, memoryview(data)[pos : pos + chunk])
        for i in done:
            assert i not in completed_at
            completed_at[i] = pos
    assert first == len(regions) and sorted(completed_at) == list(range(len(regions)))
    assert [h.hexdigest() for h in hashers] == [expected for _, expected in regions]
    # each region is reported by the chunk holding its last byte (a zero-length one: its offset)
    for i, (off, n) in enumerate(spans):
        last = off + n - 1 if n else off
        assert completed_at[i] == last // chunk * chunk, (i, off, n)

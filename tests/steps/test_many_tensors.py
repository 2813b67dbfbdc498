"""States of many small tensors (issue 25): the structure cache reuses the per-save work
that depends only on the structure, and falls back to a full flatten on any change; the
batched copy is bit-exact for every dtype and layout."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import tiercheck
from tests.steps.test_overlap import hold_background_copy
from tiercheck.errors import UnsupportedStateError
from tiercheck.plan.shards import plan_shard
from tiercheck.state.flatten import FlatState, flatten_state
from tiercheck.state.structure import StructureCache
from tiercheck.steps import stage as staging


def same_source(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr()
            and a.is_conj() == b.is_conj()
            and a.is_neg() == b.is_neg()
        )
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def assert_as_full(cache: StructureCache, state: Any, hit: bool) -> FlatState:
    """`cache.flatten(state)` is what `flatten_state(state)` gives, and (not) a cache hit."""
    hits = cache.hits
    got = cache.flatten(state)
    assert (cache.hits == hits + 1) is hit
    want = flatten_state(state)
    assert got.tree == want.tree
    assert got.leaves == want.leaves
    assert got.deferrable == want.deferrable
    assert got.unguarded == want.unguarded
    assert [id(o) for o in got.optimizers] == [id(o) for o in want.optimizers]
    assert len(got.sources) == len(want.sources)
    assert all(same_source(a, b) for a, b in zip(got.sources, want.sources, strict=True))
    return got


def small_state(n: int = 6) -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "w": {f"t{i}": torch.randn(3, 4) for i in range(n)},
        "step": 7,
        "lr": 0.5,
        "name": "run",
        "flag": True,
        "none": None,
        "list": [torch.arange(5), 3, (torch.ones(2, dtype=torch.bool), b"xy")],
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": np.float32(1.5),
    }


MUTATIONS: list[tuple[str, Callable[[dict[str, Any]], None], bool]] = [
    ("unchanged", lambda s: None, True),
    ("values changed in place", lambda s: s["w"]["t0"].add_(1), True),
    ("float changed", lambda s: s.__setitem__("lr", 0.25), True),
    ("float to -0.0", lambda s: s.__setitem__("lr", -0.0), True),
    ("float to nan", lambda s: s.__setitem__("lr", float("nan")), True),
    ("int changed", lambda s: s.__setitem__("step", 8), True),
    ("nested int changed", lambda s: s["list"].__setitem__(1, 4), True),
    ("str changed", lambda s: s.__setitem__("name", "other"), True),
    ("bool changed", lambda s: s.__setitem__("flag", False), True),
    ("bytes content changed", lambda s: s["list"].__setitem__(2, (s["list"][2][0], b"zz")), True),
    ("tensor replaced, same shape", lambda s: s["w"].__setitem__("t1", torch.randn(3, 4)), False),
    ("key added", lambda s: s["w"].__setitem__("new", torch.zeros(2)), False),
    ("key removed", lambda s: s["w"].pop("t2"), False),
    ("keys reordered", lambda s: s.__setitem__("w", dict(reversed(list(s["w"].items())))), False),
    ("dtype changed", lambda s: s["w"].__setitem__("t0", s["w"]["t0"].double()), False),
    ("data reassigned to another dtype", lambda s: setattr(s["w"]["t0"], "data", s["w"]["t0"].half()), False),
    ("resized in place", lambda s: s["w"]["t3"].resize_(4, 4), False),
    ("reallocated, same shape", lambda s: setattr(s["w"]["t4"], "data", s["w"]["t4"].clone()), False),
    ("transposed in place", lambda s: s["w"].__setitem__("t5", s["w"]["t5"].t().contiguous().t()), False),
    ("list appended", lambda s: s["list"].append(1), False),
    ("tuple in place of list", lambda s: s.__setitem__("list", tuple(s["list"])), False),
    ("int replaced by float", lambda s: s.__setitem__("step", 7.0), False),
    ("None replaced", lambda s: s.__setitem__("none", 0), False),
    ("bool replaced by int", lambda s: s.__setitem__("flag", 1), False),
    ("ndarray dtype", lambda s: s.__setitem__("np", s["np"].astype(np.int64)), False),
    ("ndarray shape", lambda s: s.__setitem__("np", s["np"].reshape(3, 2)), False),
    ("numpy scalar type", lambda s: s.__setitem__("scalar", np.float64(1.5)), False),
    ("bytes length", lambda s: s["list"].__setitem__(2, (s["list"][2][0], b"xyz")), False),
    ("new alias", lambda s: s["w"].__setitem__("t1", s["w"]["t0"]), False),
    ("moved to meta", lambda s: s["w"].__setitem__("t1", s["w"]["t1"].to("meta")), False),
]


@pytest.mark.parametrize(("name", "mutate", "hit"), MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_cache_matches_the_full_flatten(name: str, mutate: Callable[[dict[str, Any]], None], hit: bool) -> None:
    state = small_state()
    cache = StructureCache()
    assert_as_full(cache, state, hit=False)
    assert_as_full(cache, state, hit=True)
    mutate(state)
    if name == "moved to meta":
        with pytest.raises(UnsupportedStateError, match=r"state\['w'\]\['t1'\]: a meta tensor"):
            cache.flatten(state)
        return
    assert_as_full(cache, state, hit=hit)
    assert_as_full(cache, state, hit=True)  # the new structure is the cached one now


def test_changed_values_then_back() -> None:
    """A value changed and changed back: each save's tree has that save's value."""
    state = small_state()
    cache = StructureCache()
    for lr in (0.5, 0.25, 0.25, 0.5, -0.0, 0.0):
        state["lr"] = lr
        got = cache.flatten(state)
        assert got.tree == flatten_state(state).tree
    assert cache.misses == 1


def test_alias_bits_and_key_types_are_checked() -> None:
    t = torch.randn(4, dtype=torch.complex64)
    cache = StructureCache()
    state: dict[Any, Any] = {"a": t, "b": t}
    assert assert_as_full(cache, state, hit=False).leaves[1].alias_of == 0
    state["b"] = t.conj()  # same memory, strides and dtype; not the same values
    assert assert_as_full(cache, state, hit=False).leaves[1].alias_of is None
    ints: dict[Any, Any] = {1: torch.zeros(2)}
    cache.flatten(ints)
    with pytest.raises(UnsupportedStateError, match="dict keys must be str or int"):
        cache.flatten({True: ints[1]})  # True == 1 and hashes alike


class Slotted:
    """A stateful object without weak references."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t = torch.arange(3.0)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.t.copy_(sd["t"])


def test_modules_and_optimizers() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    extra = Slotted()
    state: dict[str, Any] = {"model": model, "opt": opt, "extra": extra}
    cache = StructureCache()
    assert_as_full(cache, state, hit=False)
    flat = assert_as_full(cache, state, hit=True)
    assert any(flat.deferrable)
    opt.param_groups[0]["lr"] = 5e-3  # a scheduler: a value, not the structure
    assert_as_full(cache, state, hit=True)
    opt.step()
    assert_as_full(cache, state, hit=True)
    state["opt"] = torch.optim.Adam(model.parameters(), lr=1e-2)  # another object
    assert_as_full(cache, state, hit=False)
    model[1].weight = torch.nn.Parameter(torch.randn(2, 4))  # a parameter replaced
    assert_as_full(cache, state, hit=False)
    state["opt"].add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert_as_full(cache, state, hit=False)
    state["extra"] = Slotted()
    assert_as_full(cache, state, hit=False)


def test_parameter_identities_are_checked_for_overlapping_saves_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only ``save(overlap=True)`` reads the deferral decisions that the parameters'
    identities are checked for: other saves skip that check (the tensors themselves are
    still checked), overlapping ones always make it."""
    from tiercheck.state import structure

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state: dict[str, Any] = {"model": model, "opt": opt}
    calls: list[object] = []
    real = structure._param_ids

    def spy(value: object) -> Any:
        calls.append(value)
        return real(value)

    monkeypatch.setattr(structure, "_param_ids", spy)
    cache = StructureCache()
    cache.flatten(state)
    calls.clear()
    hits = cache.hits
    cache.flatten(state, params=False)
    assert (calls, cache.hits) == ([], hits + 1)
    cache.flatten(state, params=True)
    assert calls == [model, opt] and cache.hits == hits + 2
    # An optimizer whose parameter is another tensor of the same shape: its state_dict() is
    # the same, so only the identity check sees it: a copy-everything save may reuse the
    # structure (it reads no deferral decision), an overlapping one must not.
    old = opt.param_groups[0]["params"][0]
    new = opt.param_groups[0]["params"][0] = torch.nn.Parameter(torch.zeros(4, 4))
    moved = [(new if k is old else k, v) for k, v in opt.state.items()]  # same order, same tensors
    opt.state.clear()
    opt.state.update(moved)
    cache.flatten(state, params=False)
    assert cache.hits == hits + 3
    misses = cache.misses
    cache.flatten(state, params=True)
    assert cache.misses == misses + 1
    model[1].weight = torch.nn.Parameter(torch.randn(2, 4))  # the module's own tensor: always seen
    misses = cache.misses
    cache.flatten(state, params=False)
    assert cache.misses == misses + 1
    # Through save(): the default copies everything before returning and skips the check.
    state["opt"] = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=1, run_log_interval=None) as ckpt:
        ckpt.save(1, state).wait()
        calls.clear()
        ckpt.save(2, state).wait()
        assert calls == []
        ckpt.save(3, state, overlap=True).wait()
        assert len(calls) == 2


def test_state_dict_that_raises_falls_back_to_the_full_error() -> None:
    class Flaky:
        def __init__(self) -> None:
            self.calls = 0

        def state_dict(self) -> dict[str, Any]:
            self.calls += 1
            if self.calls > 1:
                raise OSError("gone")
            return {"x": torch.zeros(1)}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            pass

    cache = StructureCache()
    flaky = Flaky()
    cache.flatten({"f": flaky})
    with pytest.raises(UnsupportedStateError, match=r"state\['f'\]: Flaky.state_dict\(\) raised"):
        cache.flatten({"f": flaky})


def load_equal(root: Path, step: int, expected: dict[str, torch.Tensor]) -> None:
    got = tiercheck.load(root, step=step)
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_saves_across_structure_changes_are_bit_exact(tmp_path: Path) -> None:
    torch.manual_seed(1)
    state: dict[str, torch.Tensor] = {f"p{i}": torch.randn(8) for i in range(300)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.prepare(state)
        steps: list[Callable[[], None]] = [
            lambda: None,
            lambda: state["p0"].mul_(2),
            lambda: state.__setitem__("p1", torch.randn(8)),
            lambda: state.__setitem__("extra", torch.arange(3)),
            lambda: state.__setitem__("p2", state["p2"].to(torch.bfloat16)),
            lambda: state["p3"].resize_(16).fill_(3.0),
            lambda: setattr(state["p4"], "data", state["p4"].clone() + 1),
            lambda: state.__setitem__("p5", state["p6"]),
            lambda: None,
        ]
        for step, change in enumerate(steps):
            change()
            expected = {k: v.clone() for k, v in state.items()}
            ckpt.save(step, state)
            for v in state.values():  # after save() returns: never part of the step
                v.fill_(-7)
            ckpt.wait()
            load_equal(tmp_path, step, expected)
            for k, v in expected.items():
                state[k].copy_(v)
        assert ckpt._planner.structure.hits >= 3


def test_an_unchanged_state_is_flattened_once(tmp_path: Path) -> None:
    state = {f"p{i}": torch.full((4,), float(i)) for i in range(50)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=2) as ckpt:
        ckpt.prepare(state)
        for step in range(4):
            ckpt.save(step, state).wait()
        assert (ckpt._planner.structure.misses, ckpt._planner.structure.hits) == (1, 4)
        assert ckpt._pool.allocations == 1
        load_equal(tmp_path, 3, state)


def test_overlap_guard_holds_on_a_cached_structure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second save reuses the structure; an edit outside optimizer.step() during its
    deferred copy still fails the step, named by key path."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    release = hold_background_copy(monkeypatch)
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None, overlap=True) as ckpt:
        release.set()
        ckpt.save(1, {"model": model, "opt": opt}).wait()
        release.clear()
        ckpt.save(2, {"model": model, "opt": opt})
        assert ckpt._planner.structure.hits == 1
        with torch.no_grad():
            model[37].bias.add_(1.0)
        release.set()
        with pytest.raises(tiercheck.TierError, match=r"state\['model'\]\['37.bias'\] changed in place"):
            ckpt.wait()
        assert ckpt.steps() == [1]


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,
    torch.complex128,
]


def random_bits(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Every bit pattern possible (NaN payloads, -0.0, subnormals): raw random bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape)) if shape else 1
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def test_batched_copy_is_bit_exact_for_every_dtype_and_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "_BATCH_BYTES", 1000)  # many batches, with ragged ends
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        base = random_bits(dtype, (6, 10), gen)
        state[f"{dtype}-contig"] = base
        state[f"{dtype}-t"] = base.t()  # non-contiguous
        state[f"{dtype}-step"] = base[::2, 1::3]  # strided slice with an offset
        state[f"{dtype}-0d"] = base[1, 2]
        state[f"{dtype}-empty"] = base[:0]
        state[f"{dtype}-expand"] = base[0:1].expand(3, 10)  # zero stride
    cache = StructureCache()
    for _ in range(2):  # a full flatten, then the cached structure
        flat = cache.flatten(state)
        plan = plan_shard(flat.leaves)
        buf = staging.HostBuffer(plan.total_bytes, pinned=False)
        staging.stage_into(buf, flat, plan)
        for leaf, off, (key, src) in zip(flat.leaves, plan.offsets, state.items(), strict=True):
            got = buf.tensor[off : off + leaf.nbytes].view(src.dtype).view(src.shape)
            want = src.contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(got.reshape(-1).view(torch.uint8), want), key
        buf.free()
    assert cache.hits == 1


def test_many_small_tensors_round_trip(tmp_path: Path) -> None:
    """3,000 leaves of mixed dtypes through save and restore, twice (the second cached)."""
    gen = torch.Generator().manual_seed(5)
    state = {f"layer{i}.w": random_bits(DTYPES[i % len(DTYPES)], (i % 5 + 1, 3), gen) for i in range(3000)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        for step in range(2):
            ckpt.save(step, state).wait()
            target = {k: torch.empty_like(v) for k, v in state.items()}
            ckpt.restore(target, step=step)
            for k, v in state.items():
                assert torch.equal(target[k].view(torch.uint8), v.view(torch.uint8)), k
            for v in state.values():
                v.view(torch.uint8).bitwise_xor_(1)


def test_a_corrupted_small_leaf_is_named(tmp_path: Path) -> None:
    """Small entries are read and hashed in runs: a flipped byte in one of them still fails
    the restore, naming that leaf."""
    from tiercheck.format import naming

    state = {f"p{i}": torch.full((64,), float(i)) for i in range(500)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.save(1, state).wait()
    (shard,) = list(tmp_path.rglob(naming.shard_name(0, 1)))
    with open(shard, "r+b") as f:  # leaf i at i * 256 (256-byte leaves, packed)
        f.seek(321 * 256 + 5)
        byte = f.read(1)
        f.seek(321 * 256 + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    target = {k: torch.zeros(64) for k in state}
    with (
        tiercheck.Checkpointer(local=tmp_path) as ckpt,
        pytest.raises(tiercheck.CheckpointCorruptedError, match=r"checksum mismatch for state\['p321'\]"),
    ):
        ckpt.restore(target, step=1)


# -- restore (issue 25): manifest entries checked in bulk, runs verified before they land


def _manifest_doc(count: int) -> dict[str, Any]:
    """A manifest of `count` float32 tensors of 3 elements, each at its own 4096 bytes, as JSON."""
    import json

    from tiercheck.format import naming
    from tiercheck.format.manifest import Entry, Manifest, ShardFile, encode_manifest

    shard = naming.shard_name(0, 1)
    entries = tuple(
        Entry(f"state['p{i}']", "tensor", "float32", (3,), shard, 4096 * i, 12, f"{i:08x}") for i in range(count)
    )
    tree = {
        "t": "dict",
        "k": [["s", f"p{i}"] for i in range(count)],
        "v": [{"t": "tensor", "e": i} for i in range(count)],
    }
    m = Manifest(1, 0, 1, "crc32c", (ShardFile(shard, 4096 * count),), entries, tree)
    doc: dict[str, Any] = json.loads(encode_manifest(m))
    return doc


ENTRY_DAMAGE: dict[str, Callable[[dict[str, Any]], None]] = {
    "not an object": lambda e: e.clear(),
    "a field missing": lambda e: e.pop("checksum"),
    "unknown kind": lambda e: e.update(kind="tensors"),
    "unknown dtype": lambda e: e.update(dtype="float33"),
    "shape not a list": lambda e: e.update(shape="3"),
    "negative dimension": lambda e: e.update(shape=[-3]),
    "bool dimension": lambda e: e.update(shape=[True, 3]),
    "too many dimensions": lambda e: e.update(shape=[1] * 65),
    "unlisted file": lambda e: e.update(file="shard-r1-of-2.bin"),
    "negative offset": lambda e: e.update(offset=-4096),
    "float offset": lambda e: e.update(offset=4096.0),
    "huge offset": lambda e: e.update(offset=2**63),
    "length not the shape's": lambda e: e.update(length=16),
    "bytes past the file": lambda e: e.update(offset=4096 * 10_000),
    "numpy scalar with a shape": lambda e: e.update(kind="npscalar", dtype="<f4"),
    "compressed entry": lambda e: e.update(codec="zstd"),
    "path not a string": lambda e: e.update(path=5),
    "checksum in capitals": lambda e: e.update(checksum="ABCD0123"),
    "empty checksum": lambda e: e.update(checksum=""),
    "checksum too long": lambda e: e.update(checksum="0" * 65),
    "checksum not a string": lambda e: e.update(checksum=123),
}


@pytest.mark.parametrize("index", [7, 4321])  # in the first and the second batch of 4096
@pytest.mark.parametrize("damage", list(ENTRY_DAMAGE))
def test_bulk_entry_checks_refuse_what_one_by_one_refuses(damage: str, index: int) -> None:
    """Entries are checked a batch at a time; one bad entry among 5,000 is still refused, by
    the one-at-a-time check, which names it."""
    import json

    from tiercheck.format.manifest import decode_manifest

    doc = _manifest_doc(5000)
    ENTRY_DAMAGE[damage](doc["entries"][index])
    with pytest.raises(tiercheck.CheckpointCorruptedError, match=rf"entries\[{index}\]"):
        decode_manifest(json.dumps(doc).encode(), "m")


def test_bulk_entry_decoding_equals_one_by_one() -> None:
    import json

    from tiercheck.format import manifest

    doc = _manifest_doc(5000)
    raw = json.loads(json.dumps(doc["entries"]))
    files = {doc["files"][0]["name"]: 4096 * 5000}
    one_by_one = [manifest._entry(e, i, files, "m", manifest._DTensorRules(2, "crc32c")) for i, e in enumerate(raw)]
    got = manifest.decode_manifest(json.dumps(doc).encode(), "m").entries
    assert list(got) == one_by_one
    assert got[4321].path == "state['p4321']" and got[4321].offset == 4096 * 4321


def test_a_damaged_run_never_reaches_the_template(tmp_path: Path) -> None:
    """Small entries are read in runs and checked before they are copied: a flipped byte in
    one leaf leaves every template tensor of its run as it was."""
    from tiercheck.format import naming

    state = {f"p{i}": torch.full((64,), float(i)) for i in range(500)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.save(1, state).wait()
    (shard,) = list(tmp_path.rglob(naming.shard_name(0, 1)))
    with open(shard, "r+b") as f:  # leaf i at i * 256 (256-byte leaves, packed)
        f.seek(321 * 256 + 5)
        byte = f.read(1)
        f.seek(321 * 256 + 5)
        f.write(bytes([byte[0] ^ 0x40]))
    target = {k: torch.full((64,), -1.0) for k in state}
    with tiercheck.Checkpointer(local=tmp_path) as ckpt, pytest.raises(tiercheck.CheckpointCorruptedError):
        ckpt.restore(target, step=1)
    for k, t in target.items():
        assert torch.equal(t, torch.full((64,), -1.0)), k


@pytest.mark.parametrize("run_bytes", [None, 4096], ids=["one run", "many runs"])
def test_one_run_is_checked_on_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_bytes: int | None
) -> None:
    """A restore that reads one run of small entries and nothing else checks it where it
    runs (no helper thread to start, nothing to overlap); several runs are checked on the
    helper thread while the next is read. Bit-exact either way."""
    import threading

    from tiercheck.steps import restore

    if run_bytes is not None:
        monkeypatch.setattr(restore, "_RUN_BYTES", run_bytes)
    threads: list[str] = []
    real = restore._verify_run

    def spy(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(restore, "_verify_run", spy)
    state = {f"p{i}": torch.full((64,), float(i)) for i in range(500)}
    with tiercheck.Checkpointer(local=tmp_path, keep_local=None) as ckpt:
        ckpt.save(1, state).wait()
        target = {k: torch.zeros(64) for k in state}
        assert ckpt.restore(target, step=1) == 1
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    if run_bytes is None:
        assert threads == [threading.current_thread().name]
    else:
        assert len(threads) > 1 and all(n.startswith("tiercheck-verify") for n in threads), threads


def test_small_tensors_of_every_kind_restore_in_place(tmp_path: Path) -> None:
    """The bulk copy of small runs: parameters, 0-d, inference tensors, bool and half, tensors
    tied in the checkpoint but not in the template and the other way round, a transposed view
    (read through the per-leaf path)."""
    gen = torch.Generator().manual_seed(3)
    tied = torch.randn(8, generator=gen)
    state: dict[str, Any] = {f"w{i}": torch.randn(i % 4 + 1, 3, generator=gen) for i in range(300)}
    state |= {
        "scalar": torch.tensor(2.5),
        "flags": torch.tensor([True, False, True]),
        "a": tied,
        "b": tied,
        "half": torch.randn(5).half(),
    }
    state |= {"t": torch.randn(3, 4, generator=gen), "c": torch.randn(6, generator=gen), "d": torch.randn(6)}
    with tiercheck.Checkpointer(local=tmp_path) as ckpt:
        ckpt.save(1, state).wait()
        target: dict[str, Any] = {k: torch.zeros_like(v) for k, v in state.items()}
        target["w5"] = torch.nn.Parameter(torch.zeros_like(state["w5"]))
        with torch.inference_mode():
            target["w6"] = torch.zeros_like(state["w6"])
        target["t"] = torch.zeros(4, 3).t()  # not contiguous
        shared = torch.zeros(6)
        target["c"] = target["d"] = shared  # one tensor in the template, two in the checkpoint
        kept = {k: v for k, v in target.items() if k not in ("c", "d")}
        ckpt.restore(target, step=1)
    for k, v in state.items():
        got, want = target[k].detach().reshape(-1), v.reshape(-1)
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)), k
    for k, v in kept.items():
        assert target[k] is v, f"{k} was not filled in place"
    assert target["c"] is shared or target["d"] is shared
    assert target["w5"].requires_grad


def test_small_tensors_written_by_address_bump_their_versions(tmp_path: Path) -> None:
    """Small leaves are copied into the template by address (`_place_run`): each written
    tensor's version counter moves as after `copy_`, so a backward pass through a graph that
    saved a parameter's earlier value is refused, not computed from the restored bytes."""
    state = {f"w{i}": torch.randn(4, 4) for i in range(50)}
    with tiercheck.Checkpointer(local=tmp_path) as ckpt:
        ckpt.save(1, state).wait()
        params = {k: torch.nn.Parameter(torch.zeros(4, 4)) for k in state}
        loss = (params["w7"] * params["w7"]).sum()  # saves w7 for its backward
        versions = {k: p._version for k, p in params.items()}
        ckpt.restore(params, step=1)
    for k, p in params.items():
        assert torch.equal(p.detach(), state[k]), k
        assert p._version > versions[k], k
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

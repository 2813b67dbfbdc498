"""Template tensors that overlap in memory (views of one storage: `b = a[1]`, `T = base.t()`,
partial slices with other strides) restore bit-exact when the checkpoint was saved from the
same overlapping memory, and are refused, changing nothing, when its values disagree
where the views overlap (docs/restore.md)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import tiercheck


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def restore_quietly(ckpt: tiercheck.Checkpointer, template: object) -> int | None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to an older step, no reported key
        return ckpt.restore(template)


def overlapping_state(base: torch.Tensor) -> dict[str, Any]:
    """Views of `base` (4 x 6 float32) that overlap in every way the rules meet."""
    return {
        "a": base,
        "row": base[1],  # inside a, contiguous
        "t": base.t(),  # the same memory, other strides
        "cols": base[:, 2:5],  # strided, partly overlapping row and t
        "step2": base.view(-1)[3:20:2],  # every other element, across rows
        "ints": base[2].view(torch.int32),  # another dtype over the same bytes
        "apart": torch.arange(5.0),  # no overlap: still read in place
    }


def test_overlapping_views_saved_from_the_same_memory_restore_bit_exact(make_ckpt):
    ckpt = make_ckpt()
    saved_base = torch.randn(4, 6)
    saved_base[0, 0] = float("nan")  # a NaN payload: bits compared, not values
    saved = overlapping_state(saved_base)
    ckpt.save(1, saved).wait()

    base = torch.zeros(4, 6)
    template = overlapping_state(base)
    apart = template["apart"] = torch.zeros(5)
    assert restore_quietly(ckpt, template) == 1
    assert bits(base) == bits(saved_base)
    for k, v in saved.items():
        assert bits(template[k]) == bits(v), k
    # the template's own views, filled in place: still views of `base`
    assert template["row"].data_ptr() == base[1].data_ptr() and template["apart"] is apart
    base[1, 0] = 7.0
    assert template["t"][0, 1] == 7.0 and template["a"][1, 0] == 7.0


def test_row_of_a_parameter_and_a_transposed_view(make_ckpt):
    """The issue's shapes: `b = a[1]` and `T = base.t()`, in a module and in a plain dict."""
    ckpt = make_ckpt()
    torch.manual_seed(0)
    model = nn.Linear(3, 4)
    w = model.weight.detach()
    ckpt.save(5, {"model": model, "b": w[1], "T": w.t()}).wait()

    fresh = nn.Linear(3, 4)
    fw = fresh.weight.detach()
    template: dict[str, Any] = {"model": fresh, "b": fw[1], "T": fw.t()}
    assert restore_quietly(ckpt, template) == 5
    assert bits(fresh.weight) == bits(model.weight) and bits(fresh.bias) == bits(model.bias)
    assert bits(template["b"]) == bits(w[1]) and bits(template["T"]) == bits(w.t())


def test_overlapping_numpy_views_restore_bit_exact(make_ckpt):
    ckpt = make_ckpt()
    saved = np.arange(24, dtype=np.float64).reshape(4, 6)
    ckpt.save(1, {"a": saved, "rev": saved[::-1, 1:4], "t": saved.T}).wait()
    base = np.zeros((4, 6))
    template: dict[str, Any] = {"a": base, "rev": base[::-1, 1:4], "t": base.T}
    assert restore_quietly(ckpt, template) == 1
    assert np.array_equal(base, saved)
    assert np.array_equal(template["rev"], saved[::-1, 1:4]) and np.array_equal(template["t"], saved.T)


def test_a_tensor_sharing_an_arrays_memory_is_checked_with_it(make_ckpt):
    """torch.from_numpy shares the array's memory: the two are one overlap, not two
    values each read in place over the other."""
    ckpt = make_ckpt()
    arr = np.arange(6, dtype=np.float32)
    ckpt.save(1, {"arr": arr, "t": torch.from_numpy(arr)[2:5]}).wait()
    ckpt.save(2, {"arr": np.zeros(6, np.float32), "t": torch.ones(3)}).wait()
    base = np.full(6, -1, np.float32)
    template: dict[str, Any] = {"arr": base, "t": torch.from_numpy(base)[2:5]}
    with pytest.raises(tiercheck.StateMismatchError, match=r"state\['arr'\] and state\['t'\].*disagree"):
        restore_quietly(ckpt, template)
    assert np.array_equal(base, np.full(6, -1, np.float32))
    assert ckpt.restore(template, step=1) == 1
    assert np.array_equal(base, arr) and torch.equal(template["t"], torch.tensor([2.0, 3.0, 4.0]))


@pytest.mark.parametrize(
    "views",
    [
        lambda b: {"a": b[0:4], "b": b[2:6]},  # partial overlap, same strides
        lambda b: {"m": b.view(2, 3), "t": b.view(3, 2).t()},  # same memory, other strides
        lambda b: {"row": b.view(2, 3)[1], "every2": b[1::2]},  # partial, other strides
    ],
    ids=["slices", "transpose", "strided"],
)
def test_values_that_disagree_on_the_overlap_are_refused_and_change_nothing(make_ckpt, views):
    """Saved from separate tensors, restored into overlapping views: no memory state reads
    back both values, so the restore is refused, the template untouched (even the keys that
    do not overlap), and no older step is tried."""
    ckpt = make_ckpt()
    ckpt.save(1, {"x": torch.full((3,), 9.0), **views(torch.arange(6.0))}).wait()
    shapes = views(torch.zeros(6))
    separate = {k: torch.full(v.shape, float(i + 1)) for i, (k, v) in enumerate(shapes.items())}
    ckpt.save(2, {"x": torch.full((3,), 5.0), **separate}).wait()

    base = torch.full((6,), -1.0)
    x = torch.zeros(3)
    template = {"x": x, **views(base)}
    with pytest.raises(tiercheck.StateMismatchError, match=r"overlap in memory.*step 2.*disagree") as info:
        restore_quietly(ckpt, template)
    names = [k for k in shapes]
    assert all(f"state['{k}']" in str(info.value) for k in names)
    assert torch.equal(base, torch.full((6,), -1.0)) and torch.equal(x, torch.zeros(3))

    assert ckpt.restore(template, step=1) == 1  # the consistent step still restores
    saved = views(torch.arange(6.0))
    assert all(torch.equal(template[k], saved[k]) for k in shapes) and torch.equal(x, torch.full((3,), 9.0))


def test_a_corrupted_overlapping_value_is_corruption_not_a_mismatch(make_ckpt, ckpt_dir):
    """The overlap is checked on verified bytes: a damaged shard falls back to the older
    step, never reads as a disagreement, and leaves the overlapping views untouched."""
    ckpt = make_ckpt()
    ckpt.save(1, {"a": torch.arange(6.0), "b": torch.arange(6.0)[2:6]}).wait()
    ckpt.save(2, {"a": torch.arange(6.0) + 10, "b": (torch.arange(6.0) + 10)[2:6]}).wait()
    shard = next((ckpt_dir / "step-000000000002").glob("*.shard"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    base = torch.zeros(6)
    with pytest.warns(RuntimeWarning, match="step 2"):
        assert ckpt.restore({"a": base, "b": base[2:6]}) == 1
    assert torch.equal(base, torch.arange(6.0))

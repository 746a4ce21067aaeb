"""Element indexing agrees with numpy, and its errors point at the column."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import finefreeze as ff
from finefreeze._plan.index import parse_index


@st.composite
def shape_and_index(draw):
    ndim = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    items, np_items, n_items = [], [], draw(st.integers(1, ndim))
    ell_at = draw(st.one_of(st.none(), st.integers(0, n_items)))
    lists = 0
    for ax in range(n_items):
        dim = shape[ax] if ell_at is None or ax < ell_at else shape[ndim - n_items + ax]
        kind = draw(st.sampled_from(["int", "slice", "list", "full"]))
        if kind == "list" and lists:  # at most one integer list: two are refused (see below)
            kind = "full"
        if kind == "int":
            i = draw(st.integers(-dim, dim - 1))
            items.append(str(i))
            np_items.append(slice(i % dim, i % dim + 1))
        elif kind == "slice":
            lo = draw(st.one_of(st.none(), st.integers(-dim, dim)))
            hi = draw(st.one_of(st.none(), st.integers(-dim, dim)))
            step = draw(st.one_of(st.none(), st.sampled_from([1, 2, 3, -1, -2])))
            text = f"{'' if lo is None else lo}:{'' if hi is None else hi}"
            if step is not None:
                text += f":{step}"
            items.append(text)
            np_items.append(slice(lo, hi, step))
        elif kind == "list":
            vals = draw(st.lists(st.integers(-dim, dim - 1), min_size=1, max_size=4))
            items.append("[" + ", ".join(map(str, vals)) + "]")
            np_items.append(sorted({v % dim for v in vals}))
            lists += 1
        else:
            items.append(":")
            np_items.append(slice(None))
    if ell_at is not None:
        items.insert(ell_at, "...")
        np_items.insert(ell_at, Ellipsis)
    return shape, "[" + ", ".join(items) + "]", tuple(np_items)


def numpy_reference(shape, np_items):
    """Outer-product selection built from numpy itself, one axis at a time."""
    n_real = sum(1 for i in np_items if i is not Ellipsis)
    if Ellipsis in np_items:
        k = np_items.index(Ellipsis)
        np_items = np_items[:k] + (slice(None),) * (len(shape) - n_real) + np_items[k + 1 :]
    np_items = np_items + (slice(None),) * (len(shape) - len(np_items))
    per_axis = [
        np.arange(d)[it] if isinstance(it, slice) else np.array(it, dtype=int) for it, d in zip(np_items, shape)
    ]
    ref = np.zeros(shape, bool)
    if all(len(a) for a in per_axis):
        ref[np.ix_(*per_axis)] = True
    return ref


@settings(max_examples=300, deadline=None)
@given(shape_and_index())
def test_index_matches_numpy(case):
    shape, text, np_items = case
    spec = parse_index(text, "v" + text, 1)
    got = spec.mask(shape, "test")
    assert np.array_equal(got, numpy_reference(shape, np_items))
    # Without integer lists, plain numpy basic indexing gives the same set.
    if not any(isinstance(i, list) for i in np_items):
        direct = np.zeros(shape, bool)
        direct[np_items] = True
        assert np.array_equal(got, direct)


def test_one_integer_list_selects_along_its_axis_and_two_are_refused():
    got = parse_index("[[0, 2], 1:3]", "v[[0, 2], 1:3]", 1).mask((3, 4), "t")
    expected = np.zeros((3, 4), bool)
    expected[np.ix_([0, 2], [1, 2])] = True
    assert np.array_equal(got, expected)
    # numpy pairs two lists, an outer product would not: refused, never guessed
    with pytest.raises(ff.PlanError, match=r"numpy would select the 2 elements \(0, 1\), \(2, 3\)"):
        parse_index("[[0, 2], [1, 3]]", "v[[0, 2], [1, 3]]", 1)


@pytest.mark.parametrize(
    "selector, column",
    [
        ("kernel[0:", 10),
        ("kernel[a]", 8),
        ("kernel[1::0]", 11),
        ("kernel[]", 8),
        ("kernel[1, 2]x", 13),
        ("kernel[[1, b]]", 12),
        ("kernel[1:2:3:4]", 13),
        ("kernel[..., ...]", 13),
    ],
)
def test_bad_index_syntax_points_at_column(selector, column):
    with pytest.raises(ff.PlanError) as e:
        ff.freeze(selector)
    msg = str(e.value)
    assert f"column {column}" in msg, msg
    assert selector in msg
    caret_line = msg.splitlines()[2]
    assert caret_line.index("^") - 4 == column - 1

"""ir/emit.py: each emitter's inferred shape is the shape its op evaluates to, the
one-dim helpers leave a value alone when nothing changes, and operands that do not fit
are refused."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gspmd.ir import Builder, Program, emit
from gspmd.ir.reducer import ADD
from gspmd.runtime import sim


def _builder():
    program = Program()
    return program, Builder(program)


def _evaluated(program, value, args):
    """What `value` evaluates to on one device (checking the inferred shape too)."""
    program.outputs = [value]
    (out,) = sim.evaluate(program, args)
    assert out.shape == value.shape and out.dtype == value.dtype
    return out


def test_layout_emitters_infer_shapes():
    program, b = _builder()
    x = b.param((2, 3, 4), np.float32)
    assert emit.transpose(b, x, (2, 0, 1)).shape == (4, 2, 3)
    assert emit.reshape(b, x, (6, 4)).shape == (6, 4)
    assert emit.broadcast(b, emit.constant(b, 1.5, np.float32), (5, 2)).shape == (5, 2)
    assert emit.broadcast(b, x, (2, 7, 3, 4), dims=(0, 2, 3)).shape == (2, 7, 3, 4)
    assert emit.concatenate(b, [x, x], 1).shape == (2, 6, 4)
    assert emit.iota(b, (3, 5), 1).dtype == emit.INDEX_DTYPE
    zero = emit.constant(b, 0, emit.INDEX_DTYPE)
    assert emit.dynamic_slice(b, x, [zero, zero, zero], (1, 2, 4)).shape == (1, 2, 4)
    assert emit.compare(b, x, x, "LT").dtype == np.bool_


def test_collectives_infer_shapes_from_their_groups():
    _, b = _builder()
    x = b.param((4, 6), np.float32)
    groups = np.arange(8).reshape(4, 2)
    assert emit.all_gather(b, x, 1, groups).shape == (4, 12)
    assert emit.reduce_scatter(b, x, 0, groups, ADD).shape == (2, 6)
    assert emit.all_to_all(b, x, 1, 0, groups).shape == (8, 3)
    assert emit.all_reduce(b, x, groups, ADD).shape == emit.collective_permute(b, x, groups).shape == (4, 6)
    with pytest.raises(ValueError, match="does not split 4 ways"):
        emit.reduce_scatter(b, x, 1, groups.reshape(2, 4), ADD)


def test_one_dim_helpers_leave_a_value_alone_when_nothing_changes():
    program, b = _builder()
    x = b.param((4, 5), np.float32)
    assert emit.pad_dim(b, x, 1, 0, 0, 0.0) is x
    assert emit.slice_dim(b, x, 0, 0, 4) is x
    assert emit.concatenate(b, [x], 0) is x
    assert not program.instrs


@pytest.mark.parametrize("make, message", [
    (lambda b, x: emit.broadcast(b, x, (3, 3)), "does not fit shape"),
    (lambda b, x: emit.reshape(b, x, (5,)), "number of elements"),
    (lambda b, x: emit.transpose(b, x, (0, 0)), "not a permutation"),
    (lambda b, x: emit.slice(b, x, (0, 0), (5, 3)), "not inside"),
    (lambda b, x: emit.select(b, emit.iota(b, (2, 3), 0), x, x), "bool mask"),
    (lambda b, x: emit.add(b, x, emit.transpose(b, x, (1, 0))), "differ in shape"),
    (lambda b, x: emit.concatenate(b, [x, emit.transpose(b, x, (1, 0))], 0), "differ beyond dim 0"),
    (lambda b, x: emit.pad(b, x, x, (0, 0), (1, 1)), "no scalar"),
    (lambda b, x: emit.pad_dim(b, x, 0, -2, -1, 0.0), "do not fit"),
])
def test_operands_that_do_not_fit_are_refused(make, message):
    _, b = _builder()
    with pytest.raises(ValueError, match=message):
        make(b, b.param((2, 3), np.float32))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=3), st.data())
def test_pad_dim_shape_is_what_pad_evaluates_to(shape, data):
    dim = data.draw(st.integers(0, len(shape) - 1))
    n = shape[dim]
    interior = data.draw(st.integers(0, 2))
    spread = (n - 1) * (interior + 1) + 1 if n else 0
    low = data.draw(st.integers(-spread, 3))
    high = data.draw(st.integers(-(spread + low), 3))
    program, b = _builder()
    x = b.param(shape, np.float32)
    arg = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    _evaluated(program, emit.pad_dim(b, x, dim, low, high, 7.0, interior), [arg])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=3), st.data())
def test_slice_shape_is_what_slice_evaluates_to(shape, data):
    start = [data.draw(st.integers(0, n)) for n in shape]
    limit = [data.draw(st.integers(s, n)) for s, n in zip(start, shape)]
    strides = [data.draw(st.integers(1, 3)) for _ in shape]
    program, b = _builder()
    x = b.param(shape, np.float32)
    arg = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    out = _evaluated(program, emit.slice(b, x, start, limit, strides), [arg])
    np.testing.assert_array_equal(out, arg[tuple(slice(s, e, k) for s, e, k in zip(start, limit, strides))])


@pytest.mark.parametrize("start, end, offset", [(None, 5, 3), (0, 5, -2), (1, 3, None)])
def test_mask_range_keeps_the_positions_in_range(start, end, offset):
    program, b = _builder()
    x = b.param((3, 6), np.float32)
    at = None if offset is None else emit.constant(b, offset, emit.INDEX_DTYPE)
    arg = np.arange(18, dtype=np.float32).reshape(3, 6)
    out = _evaluated(program, emit.mask_range(b, x, 1, start, end, -1.0, offset=at), [arg])
    pos = np.arange(6) + (offset or 0)
    inside = (pos >= (start if start is not None else pos.min())) & (pos < end)
    np.testing.assert_array_equal(out, np.where(inside[None], arg, -1.0))


def test_mask_range_takes_a_whole_value_as_fill():
    program, b = _builder()
    x, other = b.param((4,), np.float32), b.param((4,), np.float32)
    out = _evaluated(program, emit.mask_range(b, x, 0, 1, 3, other), [np.ones(4, np.float32), np.zeros(4, np.float32)])
    np.testing.assert_array_equal(out, [0, 1, 1, 0])

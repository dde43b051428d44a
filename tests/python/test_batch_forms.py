"""Batches from every form serving engines pass: lists (vLLM, SGLang),
tuples, ranges, numpy arrays of any integer dtype and int64 tensors, for
session batches, engine-level multi-pair batches and the ops' host path.
Each form moves the same bytes; bad entries are errors naming the entry."""
import os
import random
import sys

import numpy as np
import pytest
import torch

from conftest import Pair, pattern, wait_ok
from mori_torch._int64s import int64s, int64s_each

SEG = 512
N = 256


@pytest.fixture
def p():
    pair = Pair(nbytes=N * SEG)
    yield pair
    pair.close()


def _layout(seed):
    perm = list(range(N))
    random.Random(seed).shuffle(perm)
    return [i * SEG for i in range(N)], [q * SEG for q in perm], [SEG] * N


FORMS = {
    "list": lambda x: list(x),
    "tuple": lambda x: tuple(x),
    "numpy-int64": lambda x: np.asarray(x, dtype=np.int64),
    "numpy-int32": lambda x: np.asarray(x, dtype=np.int32),
    "numpy-uint64-strided": lambda x: np.repeat(np.asarray(x, dtype=np.uint64), 2)[::2],
    "tensor": lambda x: torch.tensor(x, dtype=torch.int64),
    "numpy-int-list": lambda x: [np.int64(v) for v in x],
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("op", ["write", "read"])
def test_session_batch_from_every_form_moves_the_same_bytes(p, form, op):
    lo, ro, sizes = _layout(seed=len(form))
    src = pattern(N * SEG, seed=7)
    (p.local if op == "write" else p.remote).copy_(src)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    conv = FORMS[form]
    wait_ok(getattr(sess, f"batch_{op}")(conv(lo), conv(ro), conv(sizes), sess.allocate_transfer_uid()))
    moved_to = p.remote if op == "write" else p.local
    for l_off, r_off in zip(lo, ro):
        a, b = (l_off, r_off) if op == "write" else (r_off, l_off)
        assert torch.equal(moved_to[b:b + SEG], src[a:a + SEG])


def test_a_range_and_a_generator_work_too(p):
    p.local.copy_(pattern(N * SEG, seed=3))
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    wait_ok(sess.batch_write(range(0, N * SEG, SEG), (o for o in range(0, N * SEG, SEG)), [SEG] * N, 1))
    assert torch.equal(p.remote, p.local)


@pytest.mark.parametrize("form", ["list", "numpy-int64", "tensor"])
def test_engine_batch_of_several_pairs_from_lists_and_arrays(p, form):
    src = pattern(N * SEG, seed=11)
    p.local.copy_(src)
    lo, ro, sizes = _layout(seed=5)
    k = 4
    per = N // k
    conv = FORMS[form]
    sts = p.init.batch_write(
        [p.local_desc] * k, [conv(lo[i * per:(i + 1) * per]) for i in range(k)],
        [p.remote_desc] * k, [conv(ro[i * per:(i + 1) * per]) for i in range(k)],
        [conv(sizes[:per])] * k, [p.init.allocate_transfer_uid() for _ in range(k)])
    assert len(sts) == k
    for st in sts:
        wait_ok(st)
    for l_off, r_off in zip(lo, ro):
        assert torch.equal(p.remote[r_off:r_off + SEG], src[l_off:l_off + SEG])


def test_numpy_int64_arrays_and_tensors_are_not_copied():
    a = np.arange(0, 4096 * 100, 4096, dtype=np.int64)
    assert int64s("offsets", a).data_ptr() == a.ctypes.data
    t = torch.arange(10, dtype=torch.int64)
    assert int64s("offsets", t) is t


def test_converted_lists_reuse_memory_but_never_share_it():
    """Lists land in pooled buffers (no fresh 128 KiB allocation per list and
    call): a buffer comes back once its tensor is freed, and tensors alive at
    the same time never share memory, whatever their sizes."""
    a = int64s("offsets", list(range(1000)))
    b = int64s("offsets", list(range(5000, 6000)))
    assert a.data_ptr() != b.data_ptr()
    assert torch.equal(a, torch.arange(1000)) and torch.equal(b, torch.arange(5000, 6000))
    ptr = a.data_ptr()
    del a
    c = int64s("offsets", [7] * 1000)
    assert c.data_ptr() == ptr  # the freed buffer, reused
    live = [int64s("offsets", [i] * (100 + 37 * i)) for i in range(40)]  # more than the pool keeps
    assert len({t.data_ptr() for t in live}) == len(live)
    for i, t in enumerate(live):
        assert t.numel() == 100 + 37 * i and bool((t == i).all())
    assert torch.equal(b, torch.arange(5000, 6000)) and bool((c == 7).all())
    big = int64s("offsets", list(range(300_000)))  # past the pooled size: a plain tensor
    assert torch.equal(big, torch.arange(300_000))
    empty = int64s("offsets", [])
    assert empty.numel() == 0 and empty.dtype == torch.int64


def test_list_values_of_every_width_convert_exactly():
    """One-digit, multi-digit (byte offsets past 2^30 take another path) and
    negative ints, numpy scalars (through __index__), bools, tuples."""
    values = [0, 1, (1 << 30) - 1, 1 << 30, (1 << 31) + 4096, (1 << 62) + 5, (1 << 63) - 1, -1, -(1 << 40),
              -(1 << 63), np.int64(7), np.uint32(1 << 31), True]
    want = torch.tensor([int(v) for v in values], dtype=torch.int64)
    assert torch.equal(int64s("offsets", values), want)
    assert torch.equal(int64s("offsets", tuple(values)), want)
    with pytest.raises(OverflowError, match=r"offsets\[1\] does not fit in int64"):
        int64s("offsets", [0, 1 << 63])
    with pytest.raises(OverflowError, match=r"offsets\[0\] does not fit in int64"):
        int64s("offsets", [-(1 << 63) - 1])


@pytest.mark.parametrize("n", [3000, 50_000])
def test_long_lists_convert_exactly_and_name_their_first_bad_entry(n):
    """Whatever the fast pass over small exact ints stops at (a numpy int, an
    int past 2^60, a bool, a bad entry), anywhere in a long list, is read on
    in order: the values come out exact and an error names the first bad
    entry."""
    rng = random.Random(n)
    # Mostly ints the fast loop reads (one and two digits, either sign),
    # and a few past 2^60 late in the list, where it hands over.
    values = [rng.randrange(-w, w) for w in (rng.choice((1 << 30, 1 << 60)) for _ in range(n))]
    for i in (n - 7, n - 3):
        values[i] = rng.choice((1, -1)) * rng.randrange(1 << 60, 1 << 63)
    assert int64s("offsets", values).tolist() == values
    assert int64s("offsets", tuple(values)).tolist() == values
    for i in (0, 2047, 2048, n // 2, n - 1):
        odd = list(values)
        odd[i], odd[n - 1 - i] = np.int64(-5), True
        want = list(values)
        want[i], want[n - 1 - i] = -5, 1
        assert int64s("offsets", odd).tolist() == want
    bad = list(values)
    bad[n - 1] = None
    bad[n // 2] = "x"
    with pytest.raises(TypeError, match=rf"offsets\[{n // 2}\] must be an int, got str"):
        int64s("offsets", bad)
    bad[n // 2] = values[n // 2]
    with pytest.raises(TypeError, match=rf"offsets\[{n - 1}\] must be an int, got NoneType"):
        int64s("offsets", bad)
    bad[n - 1], bad[3] = -(1 << 63) - 1, 1 << 63
    with pytest.raises(OverflowError, match=r"offsets\[3\] does not fit in int64"):
        int64s("offsets", bad)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 9, 67])
def test_one_digit_ints_read_four_at_a_time_hand_over_at_any_position(n):
    """One-digit ints are read four at a time; an entry of any other kind at
    any position of a group (or of the tail) is read exactly, reading then
    goes on four at a time, and a bad entry anywhere is named."""
    base = [(i * 4096) * (-1 if i % 5 == 3 else 1) for i in range(n)]
    others = [1 << 30, -(1 << 45), (1 << 62) + 3, -(1 << 63), np.int64(-9), np.uint16(7), True, 0]
    for pos in range(n):
        for other in others:
            values = list(base)
            values[pos] = other
            if pos + 2 < n:
                values[pos + 2] = 1 << 40  # a second hand-over in the same or the next group
            want = [int(v) for v in values]
            assert int64s("offsets", values).tolist() == want, (pos, other)
        bad = list(base)
        bad[pos] = 1.5
        with pytest.raises(TypeError, match=rf"offsets\[{pos}\] must be an int, got float"):
            int64s("offsets", bad)


def test_the_lists_of_an_engine_batch_convert_together_and_name_pair_and_entry():
    """The engine-level batch's lists (one per memory pair, 16 x 2,048
    entries here) are read in one call; errors name the pair and the entry;
    other forms mixed in convert one by one."""
    rng = random.Random(5)
    lists = [[rng.randrange(-(1 << 60), 1 << 60) for _ in range(2048)] for _ in range(16)]
    lists[3][1000] = (1 << 63) - 1  # past the fast loop's two digits, mid-list
    got = int64s_each("local_offsets", lists)
    assert [t.tolist() for t in got] == lists
    assert [t.tolist() for t in int64s_each("local_offsets", tuple(tuple(x) for x in lists))] == lists
    mixed = [lists[0], np.asarray(lists[1], dtype=np.int64), torch.tensor(lists[2]), range(3)]
    assert [t.tolist() for t in int64s_each("local_offsets", mixed)] == lists[:3] + [[0, 1, 2]]
    bad = [list(x) for x in lists]
    bad[9][2047], bad[12][0] = np.int32(3), 1.5
    with pytest.raises(TypeError, match=r"local_offsets\[12\]\[0\] must be an int, got float"):
        int64s_each("local_offsets", bad)
    bad[12][0] = 0
    want = [list(x) for x in bad]
    want[9][2047] = 3
    assert [t.tolist() for t in int64s_each("local_offsets", bad)] == want
    with pytest.raises(TypeError, match=r"sizes\[1\] must be a list, tuple, tensor or numpy array of ints, got int"):
        int64s_each("sizes", [[1], 2])


def test_an_index_that_changes_another_list_of_the_batch_is_read_as_it_is_then():
    """Lists are read one after another: a list that an earlier list's
    __index__ grew is read whole, as it is by then (no stale length)."""
    lists = [[0] * 5000, [4096] * 5000]

    class Grows:
        def __index__(self):
            lists[1].extend([8192] * 100_000)  # the second list's memory moves
            return 7

    lists[0][4999] = Grows()
    first, second = int64s_each("offsets", lists)
    assert first.tolist() == [0] * 4999 + [7]
    assert second.tolist() == [4096] * 5000 + [8192] * 100_000


def test_code_run_by_an_index_never_sees_a_half_built_result():
    """An entry's __index__ may run any Python code, gc.get_objects()
    included: it must never find the result list with empty slots."""
    import gc

    seen = []

    class Looks:
        def __index__(self):
            for o in gc.get_objects():
                if type(o) is list and len(o) == 3 and o is not lists and o is not seen:
                    seen.append([type(x) for x in o])  # touching an empty slot would crash
            return 1

    lists = [[Looks()], [2], [3]]
    assert [t.tolist() for t in int64s_each("x", lists)] == [[1], [2], [3]]


def test_a_list_that_shrinks_while_read_is_an_error_not_a_crash():
    values = [0, 4096]

    class Shrinks:
        def __index__(self):
            values.clear()
            return 8192

    values.append(Shrinks())
    values.append(12288)
    with pytest.raises(RuntimeError, match="offsets changed size while it was read"):
        int64s("offsets", values)


@pytest.mark.parametrize("bad, error, message", [
    ([0, 1.5], TypeError, r"sizes\[1\] must be an int, got float"),
    ([0, "8"], TypeError, r"sizes\[1\] must be an int, got str"),
    ([None], TypeError, r"sizes\[0\] must be an int, got NoneType"),
    ([1 << 64], OverflowError, r"sizes\[0\] does not fit in int64"),
    (8, TypeError, r"sizes must be a list, tuple, tensor or numpy array of ints, got int"),
    (np.zeros(2, dtype=np.float32), TypeError, r"sizes must hold integers, got a numpy array of float32"),
])
def test_bad_entries_are_errors_naming_the_entry_and_move_nothing(p, bad, error, message):
    before = p.remote.clone()
    p.local.fill_(0xAB)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    with pytest.raises(error, match=message):
        sess.batch_write([0, SEG], [0, SEG], bad, 1)
    with pytest.raises(error, match=message.replace("sizes", r"sizes\[0\]")):
        p.init.batch_write([p.local_desc], [[0, SEG]], [p.remote_desc], [[0, SEG]], [bad], [2])
    assert torch.equal(p.remote, before)


def test_lists_that_disagree_in_length_are_refused_clearly(p):
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    st = sess.batch_write([0, SEG], [0], [SEG, SEG], 1)
    st.Wait()
    assert st.Failed()
    assert "mismatched list lengths: local_offsets has 2, remote_offsets has 1" in st.Message()


def test_engine_batch_from_lists_goes_native_in_one_call(p):
    """Lists of lists (what SGLang passes) take one native call
    (_C.engine_batch, no TorchScript conversion); tuples and a range of uids
    too. The bytes and statuses are those of the tensor path."""
    from mori_torch import _C
    from mori_torch.io import TransferStatus

    src = pattern(N * SEG, seed=21)
    p.local.copy_(src)
    lo, ro, sizes = _layout(seed=9)
    half = N // 2
    calls = []
    real = _C.engine_batch

    def spy(*a):
        calls.append(len(a))
        return real(*a)

    _C.engine_batch = spy
    try:
        uid = p.init.allocate_transfer_uid()
        sts = p.init.batch_write(
            (p.local_desc, p.local_desc), (tuple(lo[:half]), lo[half:]), [p.remote_desc, p.remote_desc],
            [ro[:half], tuple(ro[half:])], [sizes[:half], sizes[half:]], range(uid, uid + 2))
    finally:
        _C.engine_batch = real
    assert calls == [8]
    assert len(sts) == 2 and all(type(s) is TransferStatus for s in sts)
    for st in sts:
        wait_ok(st)
    for l_off, r_off in zip(lo, ro):
        assert torch.equal(p.remote[r_off:r_off + SEG], src[l_off:l_off + SEG])


def test_engine_batch_of_tensors_and_mixed_forms_goes_native_too(p, monkeypatch):
    """Tensors (and lists beside them) reach the same native call as they
    are; numpy arrays become tensors first. Bad tensors are named by pair."""
    from mori_torch import _C, io

    seen = []
    real = _C.engine_batch

    def spy(*a):
        seen.append([[type(x).__name__ for x in a[i]] for i in (3, 5, 6)])
        return real(*a)

    monkeypatch.setattr(_C, "engine_batch", spy)
    src = pattern(N * SEG, seed=31)
    p.local.copy_(src)
    lo, ro, sizes = _layout(seed=13)
    half = N // 2
    ld, rd = p.local_desc, p.remote_desc
    sts = p.init.batch_write([ld, ld], [torch.tensor(lo[:half]), lo[half:]], [rd, rd],
                             (np.asarray(ro[:half]), torch.tensor(ro[half:])), [sizes[:half], tuple(sizes[half:])],
                             [1, 2])
    for st in sts:
        wait_ok(st)
    for l_off, r_off in zip(lo, ro):
        assert torch.equal(p.remote[r_off:r_off + SEG], src[l_off:l_off + SEG])
    assert seen == [[["Tensor", "list"], ["Tensor", "Tensor"], ["list", "tuple"]]]
    with pytest.raises(TypeError, match=r"local_offsets\[1\]: expected an int64 tensor, got Int"):
        p.init.batch_read([ld, ld], [[0], torch.tensor([0], dtype=torch.int32)], [rd, rd], [[0], [0]],
                          [[SEG], [SEG]], [3, 4])
    with pytest.raises(ValueError, match=r"sizes\[0\]: expected a 1-D tensor, got 0 dimensions"):
        p.init.batch_read([ld], [[0]], [rd], [[0]], [torch.tensor(SEG)], [5])
    with pytest.raises(TypeError, match=r"remote_offsets\[0\] must be a list, tuple or 1-D int64 tensor, got dict"):
        _C.engine_batch(p.init._e, True, [ld._d], [[0]], [rd._d], [{}], [[SEG]], [6])
    assert io._native_each([[0], torch.zeros(1, dtype=torch.int64), (1,)])
    assert not io._native_each([[0], np.zeros(1)])


def test_engine_batch_from_lists_refuses_bad_input_clearly(p):
    from mori_torch import _C

    before = p.remote.clone()
    p.local.fill_(0xCD)
    ld, rd = p.local_desc, p.remote_desc
    # Pair counts that disagree: every status fails and names the lengths.
    sts = p.init.batch_write([ld, ld], [[0], [SEG]], [rd], [[0]], [[SEG]], [1, 2])
    assert len(sts) == 2
    for st in sts:
        st.Wait()
        assert st.Failed() and "mismatched list lengths" in st.Message()
    with pytest.raises(TypeError, match=r"remote_offsets\[1\]\[0\] must be an int, got str"):
        p.init.batch_write([ld, ld], [[0], [SEG]], [rd, rd], [[0], ["x"]], [[SEG], [SEG]], [1, 2])
    with pytest.raises(OverflowError, match=r"uids\[1\] does not fit in int64"):
        p.init.batch_write([ld, ld], [[0], [SEG]], [rd, rd], [[0], [SEG]], [[SEG], [SEG]], [1, 1 << 64])
    # Out of range: that pair's status fails, the other pair's moves.
    sts = p.init.batch_write([ld, ld], [[0], [SEG]], [rd, rd], [[0], [N * SEG]], [[SEG], [SEG]], [3, 4])
    wait_ok(sts[0])
    sts[1].Wait()
    assert sts[1].Failed() and "remote" in sts[1].Message()
    assert torch.equal(p.remote[SEG:], before[SEG:])
    # The native call itself checks what it is given.
    native = p.init._e
    with pytest.raises(TypeError, match=r"engine_batch\(engine, is_read"):
        _C.engine_batch(native, False)
    with pytest.raises(TypeError, match=r"expected a torch.classes.mori.Engine, got int"):
        _C.engine_batch(7, False, [], [], [], [], [], [])
    with pytest.raises(TypeError, match=r"local_descs\[1\] must be a MemoryDesc, got str"):
        _C.engine_batch(native, False, [ld._d, "x"], [[0], [0]], [rd._d, rd._d], [[0], [0]], [[1], [1]], [1, 2])
    with pytest.raises(TypeError, match=r"sizes must be a list or tuple, got int"):
        _C.engine_batch(native, False, [ld._d], [[0]], [rd._d], [[0]], 5, [1])
    # Two bad arguments: the first in order is named (an earlier list's
    # entry before a later argument's or entry's type).
    with pytest.raises(TypeError, match=r"local_offsets\[0\]\[1\] must be an int, got str"):
        _C.engine_batch(native, False, [ld._d], [[0, "x"]], [rd._d], [[0, 0]], 5, [1])
    with pytest.raises(TypeError, match=r"local_offsets\[0\]\[1\] must be an int, got str"):
        _C.engine_batch(native, False, [ld._d, ld._d], [[0, "x"], 7], [rd._d, rd._d], [[0, 0], [0]], [[1, 1], [1]],
                        [1, 2])
    with pytest.raises(TypeError, match=r"local_offsets\[0\]\[1\] must be an int, got str"):
        _C.engine_batch(native, False, [ld._d], [[0, "x"]], [rd._d], [torch.tensor([0, 0], dtype=torch.int32)],
                        [[1, 1]], [1])


def test_engine_batch_from_lists_after_shutdown_says_so(p):
    ld, rd = p.local_desc, p.remote_desc
    p.init.shutdown()
    with pytest.raises(RuntimeError, match="is shut down"):
        p.init.batch_write([ld], [[0]], [rd], [[0]], [[SEG]], [1])


# Single transfers, session batches and waits go through plain CPython calls
# (_C.session_transfer, _C.engine_transfer, _C.session_batch, _C.status_wait)
# instead of TorchScript's method call: the same forms are accepted and bad
# values are named.


def test_single_transfers_take_any_int_form(p):
    src = pattern(N * SEG, seed=21)
    p.local.copy_(src)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    wait_ok(sess.write(np.int64(0), np.uint32(SEG), SEG, np.int64(sess.allocate_transfer_uid())))
    wait_ok(p.init.write(p.local_desc, np.int32(2 * SEG), p.remote_desc, 3 * SEG, np.uint16(SEG), 77))
    assert torch.equal(p.remote[SEG:2 * SEG], src[:SEG])
    assert torch.equal(p.remote[3 * SEG:4 * SEG], src[2 * SEG:3 * SEG])
    wait_ok(sess.read(4 * SEG, SEG, SEG, sess.allocate_transfer_uid()))
    wait_ok(p.init.read(p.local_desc, 5 * SEG, p.remote_desc, 3 * SEG, SEG, 78))
    assert torch.equal(p.local[4 * SEG:5 * SEG], src[:SEG])
    assert torch.equal(p.local[5 * SEG:6 * SEG], src[2 * SEG:3 * SEG])


def test_single_transfer_bad_arguments_are_named_and_move_nothing(p):
    from mori_torch import _C

    p.local.fill_(0xAB)
    before = p.remote.clone()
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    ld, rd = p.local_desc, p.remote_desc
    with pytest.raises(TypeError, match=r"^local_offset must be an int, got str$"):
        sess.write("0", 0, SEG, 1)
    with pytest.raises(TypeError, match=r"^remote_offset must be an int, got float$"):
        sess.read(0, 1.0, SEG, 1)
    with pytest.raises(OverflowError, match=r"^size does not fit in int64$"):
        sess.write(0, 0, 1 << 64, 1)
    with pytest.raises(TypeError, match=r"^uid must be an int, got NoneType$"):
        sess.write(0, 0, SEG, None)
    with pytest.raises(TypeError, match=r"^remote_offset must be an int, got list$"):
        p.init.write(ld, 0, rd, [0], SEG, 1)
    with pytest.raises(OverflowError, match=r"^local_offset does not fit in int64$"):
        p.init.read(ld, -(1 << 63) - 1, rd, 0, SEG, 1)
    with pytest.raises(TypeError, match="remote_dest must be a MemoryDesc, got int"):
        p.init.write(ld, 0, 5, 0, SEG, 1)
    # Values of the right type but out of range fail the status, as before.
    st = sess.write(0, N * SEG, SEG, 2)
    st.Wait()
    assert st.Failed() and "remote" in st.Message()
    assert torch.equal(p.remote, before)
    # The native calls check what they are given themselves.
    with pytest.raises(TypeError, match=r"session_transfer\(session, is_read"):
        _C.session_transfer(sess._s, False, 0, 0)
    with pytest.raises(TypeError, match="expected a torch.classes.mori.Session, got torch._C.ScriptObject"):
        _C.session_transfer(p.init._e, False, 0, 0, SEG, 1)
    with pytest.raises(TypeError, match="expected an Engine and two MemoryDesc"):
        _C.engine_transfer(p.init._e, False, ld._d, 0, "x", 0, SEG, 1)
    with pytest.raises(TypeError, match=r"engine_transfer\(engine, is_read"):
        _C.engine_transfer(p.init._e)


def test_session_batch_mixes_forms_without_converting_lists(p, monkeypatch):
    """Lists, tuples and tensors reach the native call as they are (it reads
    lists itself); numpy arrays become tensors first."""
    from mori_torch import io

    seen = []
    real = io._session_batch

    def spy(s, is_read, lo, ro, sz, uid):
        seen.append((type(lo), type(ro), type(sz)))
        return real(s, is_read, lo, ro, sz, uid)

    monkeypatch.setattr(io, "_session_batch", spy)
    lo, ro, sizes = _layout(seed=9)
    src = pattern(N * SEG, seed=22)
    p.local.copy_(src)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    wait_ok(sess.batch_write(lo, torch.tensor(ro), tuple(sizes), 5))
    wait_ok(sess.batch_write(np.asarray(lo), ro, np.asarray(sizes, dtype=np.int32), 6))
    assert seen == [(list, torch.Tensor, tuple), (torch.Tensor, list, torch.Tensor)]
    for l_off, r_off in zip(lo, ro):
        assert torch.equal(p.remote[r_off:r_off + SEG], src[l_off:l_off + SEG])


def test_strided_tensors_are_read_in_order(p):
    """A strided int64 view (a column of a table, every other entry) is
    copied to a contiguous host tensor (without the GIL) and read in order,
    in session and engine-level batches alike."""
    lo, ro, sizes = _layout(seed=17)
    src = pattern(N * SEG, seed=24)
    p.local.copy_(src)
    sess = p.init.create_session(p.local_desc, p.remote_desc)

    def strided(v):
        t = torch.tensor(v, dtype=torch.int64).repeat_interleave(2)[::2]
        assert not t.is_contiguous()
        return t

    half = N // 2
    wait_ok(sess.batch_write(strided(lo[:half]), strided(ro[:half]), strided(sizes[:half]), 7))
    for st in p.init.batch_write([p.local_desc], [strided(lo[half:])], [p.remote_desc], [strided(ro[half:])],
                                 [strided(sizes[half:])], [8]):
        wait_ok(st)
    for l_off, r_off in zip(lo, ro):
        assert torch.equal(p.remote[r_off:r_off + SEG], src[l_off:l_off + SEG])


def test_session_batch_bad_arguments_are_named(p):
    from mori_torch import _C

    sess = p.init.create_session(p.local_desc, p.remote_desc)
    with pytest.raises(TypeError, match=r"remote_offsets: expected an int64 tensor, got Int"):
        sess.batch_write([0], torch.tensor([0], dtype=torch.int32), [SEG], 1)
    with pytest.raises(ValueError, match=r"sizes: expected a 1-D tensor, got 2 dimensions"):
        sess.batch_read([0], [0], torch.full((1, 1), SEG), 1)
    with pytest.raises(TypeError, match=r"local_offsets\[1\] must be an int, got str"):
        sess.batch_read([0, "1"], [0, 1], [1, 1], 1)
    with pytest.raises(TypeError, match=r"^uid must be an int, got str$"):
        sess.batch_read([0], [0], [1], "1")
    with pytest.raises(TypeError, match=r"sizes must be a list, tuple, tensor or numpy array of ints, got int"):
        sess.batch_read([0], [0], 7, 1)
    with pytest.raises(TypeError, match=r"sizes must be a list, tuple or 1-D int64 tensor, got dict"):
        _C.session_batch(sess._s, True, [0], [0], {}, 1)
    with pytest.raises(TypeError, match=r"session_batch\(session, is_read"):
        _C.session_batch(sess._s, True)
    # Two bad arguments: the first one named, in argument order, whether the
    # later one is refused for its type (a tensor's dtype, not a list) or
    # for an entry; an earlier list is read before a later type is refused.
    with pytest.raises(TypeError, match=r"local_offsets\[1\] must be an int, got str"):
        sess.batch_write([0, "1"], torch.tensor([0, 1], dtype=torch.int32), [1, 1], 1)
    with pytest.raises(TypeError, match=r"remote_offsets\[0\] must be an int, got NoneType"):
        _C.session_batch(sess._s, True, [0, 1], [None, 1], {}, 1)
    with pytest.raises(TypeError, match=r"sizes must be a list, tuple or 1-D int64 tensor, got dict"):
        _C.session_batch(sess._s, True, [0, 1], [0, 1], {}, 1)


def test_wait_for_through_the_native_call(p):
    from mori_torch import _C
    from mori_torch.io import StatusCode

    p.local.copy_(pattern(N * SEG, seed=23))
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    st = sess.write(0, 0, N * SEG, 9)
    assert st.WaitFor(np.int64(20000)) == StatusCode.SUCCESS
    assert st.WaitFor(0) == StatusCode.SUCCESS
    assert torch.equal(p.remote, p.local)
    with pytest.raises(TypeError, match=r"^timeout_ms must be an int, got str$"):
        st.WaitFor("10")
    with pytest.raises(TypeError, match="expected a torch.classes.mori.TransferStatus, got int"):
        _C.status_wait(3, 0)
    # A status nobody started: WaitFor times out and reports what it saw.
    from mori_torch.io import TransferStatus
    assert TransferStatus().WaitFor(5) == StatusCode.INIT


_CREW_SCRIPT = r"""
import hashlib, json, sys
import numpy as np
from mori_torch._int64s import int64s, int64s_each

def outcome(f):
    try:
        r = f()
        h = hashlib.sha256()
        for t in r if isinstance(r, list) else [r]:
            h.update(t.numpy().tobytes())
            h.update(b"|")
        return ["ok", h.hexdigest()]
    except Exception as e:
        return [type(e).__name__, str(e)]

n = 20_000
base = [(i * 7919 % n) * 4096 for i in range(n)]
cases = []
for pos in (0, 2047, 2048, 2049, 4095, 4096, 12_345, n - 1):
    for odd in ("np", "big", "bool", "float", "none"):
        v = list(base)
        v[pos] = {"np": np.int64(-3), "big": (1 << 62) + 1, "bool": True, "float": 0.5, "none": None}[odd]
        cases.append(outcome(lambda: int64s("offsets", v)))
        lists = [list(base), list(base), v]  # the odd list last: the first two read by the crew
        cases.append(outcome(lambda: int64s_each("sizes", lists)))
        cases.append(outcome(lambda: int64s_each("sizes", [v, list(base)])))
json.dump(cases, sys.stdout)
"""


def test_long_lists_read_by_the_crew_come_out_as_read_alone():
    """Lists long enough for WorkCrew helpers (several chunks of 2,048) give
    the same values and the same errors with helpers and without, wherever
    the fast path's hand-over (a numpy int, an int past 2^60, a bool) or a
    bad entry falls: at chunk edges, in the first or a later list."""
    import json
    import subprocess

    out = {}
    for helpers in ("0", "3"):
        env = dict(os.environ, MORI_TORCH_SUBMIT_HELPERS=helpers, MORI_TORCH_HELPER_SPIN_US="1000")
        r = subprocess.run([sys.executable, "-c", _CREW_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out[helpers] = json.loads(r.stdout)
    assert len(out["0"]) == 8 * 5 * 3
    assert out["3"] == out["0"]
    kinds = {c[0] for c in out["0"]}
    assert kinds == {"ok", "TypeError"}, kinds
    assert ["TypeError", "offsets[2048] must be an int, got float"] in out["0"]
    assert ["TypeError", "sizes[2][4095] must be an int, got NoneType"] in out["0"]

"""TransferStatus and wait_all semantics; waits release the GIL."""
import threading
import time

import pytest

from conftest import Pair
from mori_torch.io import StatusCode, TransferStatus


def test_user_status_object():
    s = TransferStatus()
    assert s.Code() == StatusCode.INIT and s.Init() and not s.Failed()
    s.Update(StatusCode.IN_PROGRESS)
    assert s.InProgress()
    s.Update(StatusCode.ERR_NOT_FOUND, "first")
    s.Update(StatusCode.ERR_BAD_STATE, "second")
    s.Update(StatusCode.SUCCESS)
    assert s.Code() == StatusCode.ERR_NOT_FOUND and s.Message() == "first"  # first error sticks
    s.SetCode(StatusCode.SUCCESS)
    s.SetMessage("m")
    assert s.Succeeded() and s.Message() == "m"
    assert s.WaitFor(0) == StatusCode.SUCCESS
    s.Wait()


def test_polls_read_the_native_code_through_the_fast_path():
    """Code/Init/InProgress/Succeeded/Failed go through _C.status_code (no
    TorchScript method call): they agree with the native methods at every
    state, every error code counts as failed, and anything but a native
    status is a TypeError, never a crash."""
    import torch

    from mori_torch import _C

    s = TransferStatus()
    for code in (StatusCode.INIT, StatusCode.IN_PROGRESS, StatusCode.SUCCESS):
        s._s.SetCode(int(code))
        assert _C.status_code(s._s) == int(code) == s._s.Code() and s.Code() == code
        assert (s.Init(), s.InProgress(), s.Succeeded(), s.Failed()) == (
            s._s.Init(), s._s.InProgress(), s._s.Succeeded(), s._s.Failed())
    for code in StatusCode:
        if code.name.startswith("ERR_"):
            e = TransferStatus()
            e.Update(code, "x")
            assert e.Failed() and e._s.Failed() and not e.Succeeded() and e.Code() == code
    for bad in (None, 1, "status", object(), torch.zeros(1), torch.ScriptObject, Pair):
        with pytest.raises(TypeError, match="expected a torch.classes.mori.TransferStatus"):
            _C.status_code(bad)


def test_waitfor_zero_polls_and_deadline_returns_in_progress():
    s = TransferStatus()
    s.Update(StatusCode.IN_PROGRESS)
    t0 = time.monotonic()
    assert s.WaitFor(0) == StatusCode.IN_PROGRESS
    assert s.WaitFor(100) == StatusCode.IN_PROGRESS
    assert 0.09 <= time.monotonic() - t0 < 2


@pytest.mark.parametrize("how", ["Wait", "WaitFor"])
def test_wait_releases_the_gil(how):
    s = TransferStatus()
    s.Update(StatusCode.IN_PROGRESS)
    counter = [0]

    def finisher():
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.3:
            counter[0] += 1
        s.Update(StatusCode.SUCCESS)

    t = threading.Thread(target=finisher)
    t.start()
    if how == "Wait":
        s.Wait()
    else:
        assert s.WaitFor(10000) == StatusCode.SUCCESS
    t.join()
    # The Python thread ran (and ended the wait) while we were blocked.
    assert counter[0] > 1000


def _inprogress():
    s = TransferStatus()
    s.Update(StatusCode.IN_PROGRESS)
    return s


def _done(code):
    s = TransferStatus()
    s.Update(code, "x")
    return s


def test_wait_all_variants():
    p = Pair(nbytes=1 << 12)
    e = p.init
    assert e.wait_all([]) == StatusCode.SUCCESS
    assert e.wait_all([None, _done(StatusCode.SUCCESS), None]) == StatusCode.SUCCESS
    # timeout 0: one poll; a seen failure beats IN_PROGRESS.
    assert e.wait_all([_inprogress()], 0) == StatusCode.IN_PROGRESS
    assert e.wait_all([_inprogress(), _done(StatusCode.ERR_BAD_STATE)], 0) == StatusCode.ERR_BAD_STATE
    # > 0: one shared deadline.
    t0 = time.monotonic()
    assert e.wait_all([_inprogress(), _inprogress(), _inprogress()], 100) == StatusCode.IN_PROGRESS
    assert time.monotonic() - t0 < 1.0
    assert e.wait_all([_done(StatusCode.ERR_INVALID_ARGS), _inprogress()], 50) == StatusCode.ERR_INVALID_ARGS
    # < 0: waits for all, returns the first error.
    late = _inprogress()
    threading.Timer(0.1, lambda: late.Update(StatusCode.SUCCESS)).start()
    assert e.wait_all([late, _done(StatusCode.SUCCESS)]) == StatusCode.SUCCESS
    assert e.wait_all([_done(StatusCode.SUCCESS), _done(StatusCode.ERR_NOT_FOUND), _done(StatusCode.ERR_BAD_STATE)]) \
        == StatusCode.ERR_NOT_FOUND
    p.close()


def test_polling_alone_finishes_transfers():
    p = Pair(nbytes=1 << 20, num_data_conns=2)
    p.local.fill_(9)
    st = p.init.write(p.local_desc, 0, p.remote_desc, 0, 1 << 20, p.init.allocate_transfer_uid())
    deadline = time.monotonic() + 10
    while not (st.Succeeded() or st.Failed()):
        assert time.monotonic() < deadline
    assert st.Succeeded() and bool((p.remote == 9).all())
    p.close()


def test_read_notice_never_delays_initiator_status():
    """The initiator's status ends as soon as its own data landed, whether
    or not the target ever pops the notice."""
    p = Pair(nbytes=1 << 16, num_data_conns=1)
    p.remote.fill_(4)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    sts = [sess.read(0, 0, 1 << 16, sess.allocate_transfer_uid()) for _ in range(200)]
    assert p.init.wait_all(sts, 20000) == StatusCode.SUCCESS
    assert bool((p.local == 4).all())
    p.close()

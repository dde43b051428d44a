"""The TorchScript classes are usable from scripted code: a scripted
function takes engines, descriptors and sessions and moves data."""
from typing import List

import torch

from conftest import Pair
from mori_torch.io import StatusCode


@torch.jit.script
def scripted_write_read(engine: torch.classes.mori.Engine, local: torch.classes.mori.MemoryDesc,
                        remote: torch.classes.mori.MemoryDesc, nbytes: int) -> List[int]:
    codes: List[int] = []
    uid = engine.allocate_transfer_uid()
    st = engine.write(local, 0, remote, 0, nbytes, uid)
    codes.append(st.WaitFor(10000))
    sess = engine.create_session(local, remote)
    assert sess is not None
    st2 = sess.batch_read([0, nbytes // 2], [nbytes // 2, 0], [nbytes // 2, nbytes // 2],
                          sess.allocate_transfer_uid())
    st2.Wait()
    codes.append(st2.Code())
    return codes


def test_scripted_function_moves_data():
    p = Pair(nbytes=1 << 16)
    p.local.copy_(torch.arange(1 << 16, dtype=torch.int32).to(torch.uint8))
    expected = p.local.clone()
    codes = scripted_write_read(p.init._e, p.local_desc._d, p.remote_desc._d, 1 << 16)
    assert codes == [StatusCode.SUCCESS, StatusCode.SUCCESS]
    assert torch.equal(p.remote, expected)
    half = (1 << 15)
    assert torch.equal(p.local[:half], expected[half:]) and torch.equal(p.local[half:], expected[:half])
    p.close()


def test_native_classes_are_registered():
    for name in ("Engine", "Session", "TransferStatus", "EngineDesc", "MemoryDesc"):
        assert getattr(torch.classes.mori, name) is not None
    s = torch.classes.mori.TransferStatus()
    assert s.Code() == StatusCode.INIT

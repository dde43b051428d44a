"""torch.ops.mori.* on the CPU over TCP: eager transfers, errors, opcheck,
and torch.compile(fullgraph=True) of a step mixing compute and transfers."""
import pytest
import torch

from conftest import Pair
from mori_torch import ops

PAGE = 256
PAGES = 64


@pytest.fixture(scope="module")
def env():
    p = Pair(nbytes=PAGE * PAGES)
    sess = p.init.create_session(p.local_desc, p.remote_desc)
    h = ops.session_handle(sess)
    yield p, sess, h
    ops.release_session_handle(h)
    p.close()


def fill(t, seed):
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def test_handle_is_stable_per_session(env):
    p, sess, h = env
    assert ops.session_handle(sess) == h
    assert ops.session_handle(sess._s) == h


def test_single_read_and_write(env):
    p, _, h = env
    fill(p.remote, 1)
    ops.read(h, p.local, 10, 1000, 500)
    assert torch.equal(p.local[10:510], p.remote[1000:1500])
    fill(p.local, 2)
    ops.write(h, p.local, 7, 3, 99)
    assert torch.equal(p.remote[3:102], p.local[7:106])


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensors", "lists"])
def test_batch_read_and_write(env, as_tensor):
    p, _, h = env
    fill(p.remote, 3)
    lo, ro, sz = [0, 300, 5000], [9000, 10, 2000], [100, 200, 300]
    conv = (lambda v: torch.tensor(v)) if as_tensor else (lambda v: v)
    ops.batch_read(h, p.local, conv(lo), conv(ro), conv(sz))
    for a, b, n in zip(lo, ro, sz):
        assert torch.equal(p.local[a:a + n], p.remote[b:b + n])
    fill(p.local, 4)
    ops.batch_write(h, p.local, conv(lo), conv(ro), conv([64]))  # one size for all
    for a, b in zip(lo, ro):
        assert torch.equal(p.remote[b:b + 64], p.local[a:a + 64])


def test_pages(env):
    p, _, h = env
    fill(p.remote, 5)
    ops.read_pages(h, p.local, torch.tensor([0, 5, 9]), torch.tensor([63, 2, 9]), PAGE)
    lv, rv = p.local.view(PAGES, PAGE), p.remote.view(PAGES, PAGE)
    assert torch.equal(lv[[0, 5, 9]], rv[[63, 2, 9]])
    fill(p.local, 6)
    ops.write_pages(h, p.local, torch.tensor([1, 2]), torch.tensor([40, 41]), PAGE)
    assert torch.equal(rv[[40, 41]], lv[[1, 2]])


def test_a_copy_of_local_is_staged_through_the_registration(env):
    p, _, h = env
    fill(p.remote, 7)
    copy = torch.zeros_like(p.local)
    ops.read_pages(h, copy, torch.tensor([3]), torch.tensor([4]), PAGE)
    assert torch.equal(copy[3 * PAGE:4 * PAGE], p.remote[4 * PAGE:5 * PAGE])
    assert int(copy[:3 * PAGE].count_nonzero()) == 0  # only the listed page changed


def test_errors_name_the_bad_values(env):
    p, _, h = env
    with pytest.raises(ValueError, match="remote range out of bounds: offset 16384"):
        ops.read(h, p.local, 0, PAGE * PAGES, 1)
    with pytest.raises(ValueError, match="got 16383 bytes"):
        ops.read(h, p.local[1:], 0, 0, 1)
    with pytest.raises(ValueError, match="session handle 987654 is unknown"):
        ops.read(987654, p.local, 0, 0, 1)
    with pytest.raises(ValueError, match="mismatched list lengths: local_offsets has 2, remote_offsets has 1"):
        ops.batch_read(h, p.local, [0, 1], [0], [1])
    with pytest.raises(TypeError, match="int64"):
        ops.batch_read(h, p.local, torch.tensor([0], dtype=torch.int32), torch.tensor([0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="negative or overflowing"):
        ops.read_pages(h, p.local, torch.tensor([-1]), torch.tensor([0]), PAGE)
    with pytest.raises(ValueError, match="segment 1: remote range out of bounds"):
        ops.read_pages(h, p.local, torch.tensor([0, 1]), torch.tensor([0, PAGES]), PAGE)
    with pytest.raises(ValueError, match="page_bytes must be positive"):
        ops.read_pages(h, p.local, torch.tensor([0]), torch.tensor([0]), 0)
    ops.check_errors(h)  # synchronous errors raised already; nothing pending


OPCHECK_CASES = {
    "read": lambda h, t: (h, t, 0, 128, 64),
    "write": lambda h, t: (h, t, 64, 0, 32),
    "batch_read": lambda h, t: (h, t, torch.tensor([0, 512]), torch.tensor([1024, 256]), torch.tensor([16, 40])),
    "batch_write": lambda h, t: (h, t, torch.tensor([0, 512]), torch.tensor([2048, 4096]), torch.tensor([24])),
    "read_pages": lambda h, t: (h, t, torch.tensor([0, 3]), torch.tensor([5, 1]), PAGE),
    "write_pages": lambda h, t: (h, t, torch.tensor([2, 3]), torch.tensor([50, 51]), PAGE),
}


@pytest.mark.parametrize("name", sorted(OPCHECK_CASES))
def test_opcheck(env, name):
    p, _, h = env
    fill(p.remote, 8)
    fill(p.local, 9)
    torch.library.opcheck(getattr(torch.ops.mori, name).default, OPCHECK_CASES[name](h, p.local))


def make_step(h):
    """A model-like step: compute fills pages, writes them to the peer, pulls
    other pages back, and consumes them."""

    def step(local, out_pages, remote_out, in_pages, remote_in, scale):
        lv = local.view(PAGES, PAGE)
        produced = (torch.arange(PAGE, dtype=torch.int32) * scale + out_pages.to(torch.int32)[:, None]) % 251
        lv[out_pages] = produced.to(torch.uint8)
        ops.write_pages(h, local, out_pages, remote_out, PAGE)
        ops.read_pages(h, local, in_pages, remote_in, PAGE)
        return lv[in_pages].to(torch.float32).sum(dim=1) * scale

    return step


def run_steps(step, p, seed):
    fill(p.remote, seed)
    p.local.zero_()
    sums = []
    for i in range(3):
        out_pages = torch.tensor([i, i + 8])
        remote_out = torch.tensor([32 + i, 40 + i])
        in_pages = torch.tensor([20 + i, 30 + i])
        remote_in = torch.tensor([32 + i, 5 + i])  # the first was written just before
        sums.append(step(p.local, out_pages, remote_out, in_pages, remote_in, 3 + i))
    return torch.stack(sums), p.local.clone(), p.remote.clone()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(env, backend):
    p, _, h = env
    torch._dynamo.reset()
    step = make_step(h)
    want = run_steps(step, p, seed=11)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    got = run_steps(compiled, p, seed=11)
    for w, g in zip(want, got):
        assert torch.equal(w, g)
    # The writes reached the peer (not dropped as dead code).
    assert int(got[2].view(PAGES, PAGE)[40:43].count_nonzero()) > 0


def test_compiled_write_alone_is_not_eliminated(env):
    p, _, h = env
    torch._dynamo.reset()

    @torch.compile(fullgraph=True)
    def push(local, pages):
        ops.write_pages(h, local, pages, pages, PAGE)

    fill(p.local, 12)
    p.remote.zero_()
    push(p.local, torch.tensor([7]))
    assert torch.equal(p.remote[7 * PAGE:8 * PAGE], p.local[7 * PAGE:8 * PAGE])

"""mori_torch.paged_kv on the CPU: block ids -> byte ranges and page indices
for vLLM 0.33's per-layer views (LBNHC, LBHNC, BLNHC) and the classic
[2, blocks, block_size, heads, head_dim]; per-layer pulls over TCP between
caches of different sizes, checked byte for byte; bad input."""
import pytest
import torch

from conftest import make_engine
from kv_layouts import LAYOUTS, block_bytes, block_of, classic_caches, layer_name, randomize, vllm_caches
from mori_torch import ops
from mori_torch.io import MemoryDesc
from mori_torch.paged_kv import KVLayout, LayerPages, PageTables, StaticPageTables, layer_pages, pull_layer

SHAPE = dict(layers=3, heads=2, block_size=4, c2=16)  # page: 2*4*16*2 = 256 bytes


def make(kind, blocks, header=0, device="cpu"):
    if kind == "classic":
        return classic_caches(3, blocks, 4, 2, 8, device=device)
    return vllm_caches(kind, blocks=blocks, header=header, device=device, **SHAPE)


@pytest.mark.parametrize("kind", LAYOUTS + ("classic",))
def test_each_block_is_its_byte_ranges(kind):
    buf, caches = make(kind, blocks=5)
    layout = KVLayout.from_caches(caches, buf)
    for li, cache in enumerate(caches.values()):
        for b in range(5):
            block_of(cache, b).fill_(100 * li + b)  # exact in bf16/fp16
    seen = torch.zeros(buf.numel(), dtype=torch.int32)
    for li, name in enumerate(caches):
        pages = layout.layers[name]
        assert pages.page_aligned
        offs = pages.byte_offsets(torch.arange(5))
        assert offs.numel() == 5 * (2 if kind == "classic" else 1)
        for i, off in enumerate(offs.tolist()):
            b = i // len(pages.seg_offsets)
            chunk = buf[off:off + pages.seg_bytes].view(caches[name].dtype)
            assert bool((chunk == 100 * li + b).all()), (name, b)
            seen[off:off + pages.seg_bytes] += 1
    assert bool((seen == 1).all())  # every byte of the buffer belongs to exactly one (layer, block, segment)


@pytest.fixture
def link():
    a, b = make_engine("kva"), make_engine("kvb")
    a.register_remote_engine(b.get_engine_desc())
    handles = []

    def connect(local_buf, remote_buf):
        ld = a.register_torch_tensor(local_buf)
        rd = MemoryDesc.unpack(b.register_torch_tensor(remote_buf).pack())
        s = a.create_session(ld, rd)
        handles.append((s, ops.session_handle(s)))
        return handles[-1][1]

    yield connect
    for _, h in handles:
        ops.release_session_handle(h)
    a.shutdown()
    b.shutdown()


@pytest.mark.parametrize("kind", LAYOUTS + ("classic",))
def test_pull_between_caches_of_different_sizes(link, kind):
    lbuf, local = make(kind, blocks=12)
    rbuf, remote = make(kind, blocks=9)
    randomize(rbuf, 11)
    h = link(lbuf, rbuf)
    lids, rids = [3, 4, 7, 11], [8, 0, 2, 5]
    tables = PageTables(KVLayout.from_caches(local, lbuf), KVLayout.from_caches(remote, rbuf), lids, rids)
    assert tables.num_blocks == 4
    for name in local:
        assert tables[name].page_bytes > 0  # page indices: read_pages
        assert tables[name].local.dtype == torch.int64
        pull_layer(h, lbuf, tables[name])
    for name in local:
        for lb in range(12):
            got = block_bytes(local[name], lb)
            if lb in lids:
                assert torch.equal(got, block_bytes(remote[name], rids[lids.index(lb)])), (name, lb)
            else:
                assert int(got.count_nonzero()) == 0, (name, lb)  # untouched


def test_unaligned_caches_pull_by_byte_offsets(link):
    lbuf, local = make("LBNHC", blocks=6, header=64)  # 64 is no multiple of the 256-byte page
    rbuf, remote = make("BLNHC", blocks=6)
    # Same arrangement inside a block (N, H, C), so LBNHC <- BLNHC pulls.
    randomize(rbuf, 12)
    h = link(lbuf, rbuf)
    tables = PageTables(KVLayout.from_caches(local, lbuf), KVLayout.from_caches(remote, rbuf), [1, 5], [4, 2])
    for name in local:
        assert tables[name].page_bytes == 0 and tables[name].sizes.tolist() == [256]
        pull_layer(h, lbuf, tables[name])
        assert torch.equal(block_bytes(local[name], 1), block_bytes(remote[name], 4))
        assert torch.equal(block_bytes(local[name], 5), block_bytes(remote[name], 2))


def test_a_different_arrangement_inside_blocks_is_refused():
    lbuf, local = make("LBNHC", blocks=4)
    rbuf, remote = make("LBHNC", blocks=4)
    with pytest.raises(ValueError, match=r"layer 'model.layers.0.self_attn.attn': "
                                         r"remote .*\(H2.N4.C16.bfloat16\), local .*\(N4.H2.C16.bfloat16\)"):
        KVLayout.from_caches(local, lbuf).check_pullable_from(KVLayout.from_caches(remote, rbuf))
    _, other = vllm_caches("LBNHC", layers=2, blocks=4, heads=2, block_size=4, c2=16)
    with pytest.raises(ValueError, match="no layer 'model.layers.2.self_attn.attn'"):
        KVLayout.from_caches(local, lbuf).check_pullable_from(KVLayout.from_caches(other, _))


def test_bad_block_ids_and_lists_name_the_value():
    lbuf, local = make("LBNHC", blocks=4)
    lay = KVLayout.from_caches(local, lbuf)
    with pytest.raises(ValueError, match="local block ids: block id 4 is out of range"):
        PageTables(lay, lay, [0, 4], [0, 1])
    with pytest.raises(ValueError, match="remote block ids: block id -1 is out of range"):
        PageTables(lay, lay, [0], [-1])
    with pytest.raises(ValueError, match="2 local block ids but 1 remote"):
        PageTables(lay, lay, [0, 1], [0])
    assert PageTables(lay, lay, [], []).num_blocks == 0


def test_caches_that_are_not_views_of_the_memory_are_refused():
    lbuf, local = make("LBNHC", blocks=4)
    name = layer_name(0)
    with pytest.raises(ValueError, match="is it a view into that memory"):
        layer_pages(torch.zeros_like(local[name]), lbuf)
    with pytest.raises(ValueError, match="is it a view into that memory"):
        layer_pages(local[name], lbuf[1024:])  # starts before the memory
    with pytest.raises(ValueError, match="not one dense run"):
        layer_pages(local[name][:, :, ::2], lbuf)
    with pytest.raises(ValueError, match="cannot tell the layout"):
        layer_pages(lbuf, lbuf)
    with pytest.raises(ValueError, match="kind must be"):
        layer_pages(local[name], lbuf, kind="nhd")


@pytest.mark.parametrize("bad,match", [
    ([], "must be a mapping"),
    ({"layers": {}}, "memory_bytes must be a positive int"),
    ({"layers": {}, "memory_bytes": 10}, "1 to 4096 layers"),
    ({"layers": {f"l{i}": {} for i in range(5000)}, "memory_bytes": 10}, "at most 4096 layers"),
    ({"layers": {"a": {"offset": 0}}, "memory_bytes": 10}, "lack the field 'seg_offsets'"),
    ({"layers": {"a": {"offset": -1, "block_stride": 1, "seg_bytes": 1, "seg_offsets": [0], "num_blocks": 1}},
      "memory_bytes": 10}, "offset must be a non-negative int, got -1"),
    ({"layers": {"a": {"offset": 0, "block_stride": 1, "seg_bytes": 1, "seg_offsets": [0, 1, 2],
                       "num_blocks": 1}}, "memory_bytes": 10}, "at most 2 ints"),
    ({"layers": {"a": {"offset": 0, "block_stride": 8, "seg_bytes": 8, "seg_offsets": [0], "num_blocks": 2}},
      "memory_bytes": 10}, "ends at byte 16, past the memory's 10"),
    ({"layers": {"a": {"offset": 0, "block_stride": 1, "seg_bytes": 1, "seg_offsets": [0], "num_blocks": 1,
                       "block_shape": "x" * 200}}, "memory_bytes": 10}, "at most 128 characters"),
])
def test_a_malformed_peer_layout_is_a_clear_error(bad, match):
    with pytest.raises(ValueError, match=match):
        KVLayout.from_dict(bad)


def test_layout_round_trips_through_a_dict():
    lbuf, local = make("classic", blocks=4)
    lay = KVLayout.from_caches(local, lbuf)
    assert KVLayout.from_dict(lay.to_dict()) == lay


def test_static_tables_are_filled_in_place_and_padded(link):
    lbuf, local = make("BLNHC", blocks=8)
    rbuf, remote = make("BLNHC", blocks=8)
    randomize(rbuf, 13)
    h = link(lbuf, rbuf)
    ll, rl = KVLayout.from_caches(local, lbuf), KVLayout.from_caches(remote, rbuf)
    st = StaticPageTables(ll, rl, capacity=4, device="cpu")
    ptrs = {n: (st[n].local.data_ptr(), st[n].remote.data_ptr()) for n in local}
    for step, (lids, rids) in enumerate([([1, 2], [7, 6]), ([3, 4, 5, 6], [1, 2, 3, 4]), ([7], [5])]):
        st.set(lids, rids)
        assert st.num_blocks == len(lids)
        for n in local:
            assert (st[n].local.data_ptr(), st[n].remote.data_ptr()) == ptrs[n]
            assert st[n].local.numel() == 4
            pad = ll.layers[n].byte_offsets(torch.tensor([0])) // ll.layers[n].seg_bytes
            assert st[n].local[len(lids):].tolist() == pad.tolist() * (4 - len(lids))
            pull_layer(h, lbuf, st[n])
            for lb, rb in zip(lids, rids):
                assert torch.equal(block_bytes(local[n], lb), block_bytes(remote[n], rb)), (step, n, lb)
    with pytest.raises(ValueError, match="5 blocks exceed the capacity of 4"):
        st.set([1, 2, 3, 4, 5], [1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        StaticPageTables(ll, rl, capacity=0, device="cpu")


def test_layer_pages_validates_its_fields():
    with pytest.raises(ValueError, match="seg_bytes and num_blocks must be positive"):
        LayerPages(0, 16, 0, (0,), 1)
    with pytest.raises(ValueError, match="num_blocks must be a non-negative int, got True"):
        LayerPages(0, 16, 16, (0,), True)

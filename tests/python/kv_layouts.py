"""Paged KV caches laid out as vLLM 0.33's allocate_kv_cache lays them out
(one flat buffer; per-layer [num_blocks, heads, block_size, 2*head_size]
views whose strides follow the KV cache layout), and the classic
[2, num_blocks, block_size, heads, head_dim] per layer, for tests that run
without vLLM (the vLLM tests use vLLM's own allocator)."""
import torch

LAYOUTS = ("LBNHC", "LBHNC", "BLNHC")


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def vllm_caches(layout, layers, blocks, heads, block_size, c2, dtype=torch.bfloat16, device="cpu", header=0):
    """(flat uint8 buffer, {layer name: view}). ``header`` bytes precede the
    caches (a multiple of the element size)."""
    esz = torch.empty(0, dtype=dtype).element_size()
    page = heads * block_size * c2 * esz
    buf = torch.zeros(header + layers * blocks * page, dtype=torch.uint8, device=device)
    body = buf[header:].view(dtype)
    if layout == "LBNHC":
        t = body.view(layers, blocks, block_size, heads, c2)
        views = [t[i].permute(0, 2, 1, 3) for i in range(layers)]
    elif layout == "LBHNC":
        t = body.view(layers, blocks, heads, block_size, c2)
        views = [t[i] for i in range(layers)]
    elif layout == "BLNHC":
        t = body.view(blocks, layers, block_size, heads, c2)
        views = [t[:, i].permute(0, 2, 1, 3) for i in range(layers)]
    else:
        raise ValueError(layout)
    return buf, {layer_name(i): v for i, v in enumerate(views)}


def classic_caches(layers, blocks, block_size, heads, head_dim, dtype=torch.float16, device="cpu"):
    esz = torch.empty(0, dtype=dtype).element_size()
    buf = torch.zeros(layers * 2 * blocks * block_size * heads * head_dim * esz, dtype=torch.uint8, device=device)
    t = buf.view(dtype).view(layers, 2, blocks, block_size, heads, head_dim)
    return buf, {layer_name(i): t[i] for i in range(layers)}


def block_of(cache: torch.Tensor, b: int) -> torch.Tensor:
    """Block b of a layer cache (K and V for the classic layout)."""
    return cache[:, b] if cache.dim() == 5 else cache[b]


def randomize(buf: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g).to(buf.device))


def block_bytes(cache: torch.Tensor, b: int) -> torch.Tensor:
    """Block b as raw bytes in logical order (comparable across layouts
    with the same logical shape; random bytes may be NaNs as floats)."""
    return block_of(cache, b).contiguous().view(torch.uint8).cpu()

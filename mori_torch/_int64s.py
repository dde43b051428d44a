"""Offsets, sizes and page lists as int64 tensors, from whatever serving
engines pass: Python lists (vLLM and SGLang do), tuples, numpy arrays,
tensors."""
from __future__ import annotations

import torch

from . import _C


def int64s(what: str, v) -> torch.Tensor:
    """Offsets or sizes as a 1-D int64 tensor for the native batch path.

    Lists and tuples are read in one pass in C (a few ns per entry; the
    TorchScript List[int] boundary costs about 20). Tensors pass as they are,
    and numpy integer arrays without a copy when they are int64 already.
    Anything else iterable (range, array.array, a generator) goes through a
    list first.
    """
    tv = type(v)
    if tv is list or tv is tuple:
        return _C.int64_tensor(v, what)
    if isinstance(v, torch.Tensor):
        return v
    if tv.__module__ == "numpy" and hasattr(v, "dtype"):  # numpy is not imported here unless the caller did
        if v.dtype.kind not in "iu":
            raise TypeError(f"{what} must hold integers, got a numpy array of {v.dtype}")
        t = torch.from_numpy(v) if v.flags.writeable else torch.from_numpy(v.copy())
        return t if t.dtype == torch.int64 else t.to(torch.int64)
    try:
        return _C.int64_tensor(list(v), what)
    except TypeError as e:
        if "is not iterable" in str(e):
            raise TypeError(f"{what} must be a list, tuple, tensor or numpy array of ints, got {tv.__name__}") from None
        raise


def int64s_each(what: str, seqs) -> list:
    """One 1-D int64 tensor per entry of ``seqs`` (the engine-level batch's
    lists, one per memory pair); errors name ``what[i]``.

    When every entry is a list or tuple, all are read in one call in C;
    tensors pass as they are; anything else as ``int64s`` (its name is
    formatted only then: it costs as much as passing a tensor).
    """
    if type(seqs) is not list and type(seqs) is not tuple:
        seqs = list(seqs)
    if all(type(v) is list or type(v) is tuple for v in seqs):
        return _C.int64_tensors(seqs, what)
    return [v if isinstance(v, torch.Tensor) else int64s(f"{what}[{i}]", v) for i, v in enumerate(seqs)]

"""numpy arrays and torch tensors in, as the C++ side takes them, copying only when the layout needs it."""
from __future__ import annotations

import sys

import numpy as np

from ._kvslim import InputError


def _torch():
    # torch is optional: only consulted when the caller already imported it.
    return sys.modules.get("torch")


def as_block(x, name: str):
    """(array, dtype hint) over the same memory as `x` when it is a C-contiguous CPU fp32/fp16/bf16
    tensor or array; a contiguous CPU copy otherwise (other device, strided layout)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if t.dtype == torch.float32:
            return t.numpy(), "f32"
        if t.dtype == torch.float16:
            return t.numpy(), "f16"
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy(), "bf16"  # numpy has no bf16: raw bits
        raise InputError(f"{name}: torch dtype {t.dtype} is not float32, float16 or bfloat16")
    if isinstance(x, np.ndarray):
        if x.dtype not in (np.float32, np.float16):
            raise InputError(f"{name}: numpy dtype {x.dtype} is not float32 or float16 "
                             "(bf16 bits: pass a torch bfloat16 tensor)")
        return np.ascontiguousarray(x), ""
    raise InputError(f"{name}: expected a numpy array or torch tensor, got {type(x).__name__}")


def as_positions(p, name: str = "positions"):
    if p is None:
        return None
    torch = _torch()
    if torch is not None and isinstance(p, torch.Tensor):
        p = p.detach().cpu().numpy()
    a = np.asarray(p)
    if a.dtype.kind not in "iu":
        raise InputError(f"{name}: positions must be integers, got {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize >= 8 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        # uint64 above 2^63 - 1 used to wrap to negative int64 positions (issue 26).
        raise InputError(f"{name}: position {int(a.max())} is above the largest position, {np.iinfo(np.int64).max}")
    return np.ascontiguousarray(a, dtype=np.int64)


def as_float32(x, name: str):
    """fp32 C-contiguous numpy array (observation inputs)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    if not isinstance(x, np.ndarray):
        raise InputError(f"{name}: expected a numpy array or torch tensor, got {type(x).__name__}")
    return np.ascontiguousarray(x, dtype=np.float32)


def is_cuda_tensor(x) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor) and x.device.type == "cuda"


_CUDA_DTYPES: dict = {}  # torch dtype -> the library's name (filled on first use: torch is optional)


def raw_stream(device) -> int:
    """torch's current CUDA stream on `device`, as the integer handle the library takes. The raw
    getter costs a fraction of torch.cuda.current_stream() (which builds a Stream object), and it
    runs twice per layer and decode step."""
    torch = _torch()
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def cuda_block(x, name: str, stream: bool = True):
    """(tensor, dtype name, stream) of a CUDA tensor for the device caches: read in place (a
    non-contiguous tensor is made contiguous on its GPU, never copied through the host); the stream
    is torch's current stream on that device (None when not asked), so kvslim's kernels follow the
    caller's work."""
    torch = _torch()
    if not _CUDA_DTYPES:
        _CUDA_DTYPES.update({torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"})
    t = x.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    kind = _CUDA_DTYPES.get(t.dtype)
    if kind is None:
        raise InputError(f"{name}: torch dtype {t.dtype} is not float32, float16 or bfloat16")
    if t.dim() != 4:
        raise InputError(f"{name}: expected 4 dimensions, got {t.dim()}")
    return t, kind, (raw_stream(t.device) if stream else None)

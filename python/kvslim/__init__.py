"""kvslim: bounded, compressed KV caches for LLM inference (Python binding of the C++ library).

    import kvslim
    cfg = kvslim.Config(method="squeeze", squeeze_budget=128)
    caches = kvslim.CacheSet(cfg, num_layers=4, kv_heads=2, head_dim=64)
    view = caches[0].update(keys, values)      # numpy arrays or torch tensors, [B, H_kv, S, D]
    caches.resident_bytes()

GPU: Config(..., device="cuda") makes caches whose storage and kernels live in GPU memory; append
and attend then take torch CUDA tensors (read in place, on torch's current stream).

HF transformers models: see kvslim.hf.
"""
from ._kvslim import ConfigError, InputError, attend_kernels, simd_target
from ._kvslim import cuda_built, cuda_device_count, cuda_device_description
from ._config import Config, method_info, methods, storages, variants
from ._cache import Cache, CacheSet, StaleViewError, View



def has_attend() -> bool:
    """Whether this build has the attend contract (Cache.append/attend/rows: attention computed by
    each cache over its own, compressed, storage)."""
    from ._kvslim import has_attend as flag
    return bool(flag)


__all__ = [
    "Config", "ConfigError", "InputError", "Cache", "CacheSet", "StaleViewError", "View", "attend_kernels", "has_attend",
    "method_info", "methods", "storages", "variants", "simd_target", "cuda_built", "cuda_device_count", "cuda_device_description",
]
__version__ = "0.1.0"

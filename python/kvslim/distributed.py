"""kvslim under tensor parallelism: each rank's CacheSet holds a slice of every layer's KV heads.

What a layer decides from all of its heads (squeeze's per-layer schedule, the cross-layer
importance board of h2o / squeeze / pyramidkv) goes through one seam, the C++ RankGather: kvslim
hands it this rank's per-layer statistics and gets every rank's back, in rank order, then combines
them in the single-process head order. Here it is a torch.distributed all_gather, so each rank
decides exactly what one process over all heads would (docs/distributed.md).

    import torch.distributed as dist, kvslim, kvslim.distributed
    caches = kvslim.CacheSet(cfg, num_layers=L, kv_heads=stop - start, head_dim=D)
    kvslim.distributed.shard(caches, head_slice=(start, stop), kv_heads=H)   # a collective
    caches[i].update(keys[:, start:stop], values[:, start:stop])

A transformers model loaded with from_pretrained(..., tp_plan="auto") needs none of this by hand:
kvslim.hf.KVSlimCache(model, cfg) reads the model's layout (model_layout) and shards itself.
"""
from __future__ import annotations

from . import _kvslim
from ._cache import CacheSet


def _torch():
    import torch
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise _kvslim.InputError("kvslim.distributed: torch.distributed is not initialized (call "
                                 "torch.distributed.init_process_group first)")
    return torch, dist


class TensorParallel(_kvslim.RankGather):
    """A RankGather over a torch.distributed process group (None: the default group): all_gather
    of a variable-length float64 vector (sizes first, then the padded vectors). gloo on the CPU;
    nccl gathers on this rank's current CUDA device."""

    def __init__(self, group=None):
        super().__init__()
        torch, dist = _torch()
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def all_gather(self, local):
        """local: a float64 numpy array (or sequence); returns every rank's, in rank order."""
        torch, dist = _torch()
        mine = torch.as_tensor(local, dtype=torch.float64).to(self._device)
        size = torch.tensor([mine.numel()], dtype=torch.int64, device=self._device)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        sizes = [int(s.item()) for s in sizes]
        longest = max(sizes)
        padded = torch.zeros(longest, dtype=torch.float64, device=self._device)
        padded[:mine.numel()] = mine
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(out, padded, group=self.group)
        return [o[:n].cpu().numpy() for o, n in zip(out, sizes)]


def check_slices(slices, kv_heads: int) -> None:
    """Raises InputError unless `slices` (each rank's (start, stop), in rank order) tile
    [0, kv_heads) in order, each non-empty: the order RankGather's callers assume."""
    at = 0
    for rank, (start, stop) in enumerate(slices):
        if start != at or stop <= start:
            raise _kvslim.InputError(
                f"kvslim.distributed: rank {rank}'s head slice [{start}, {stop}) does not continue at head {at}: the "
                f"ranks' slices, in rank order, must tile [0, {kv_heads}) ({[tuple(s) for s in slices]})")
        at = stop
    if at != kv_heads:
        raise _kvslim.InputError(
            f"kvslim.distributed: the ranks' head slices {[tuple(s) for s in slices]} end at head {at}, not at kv_heads "
            f"= {kv_heads} (a world size of {len(slices)} for this model?)")


def shard(caches: CacheSet, head_slice, kv_heads: int, group=None) -> TensorParallel:
    """Declares that `caches` holds heads [start, stop) of every layer's `kv_heads` KV heads and
    installs the torch.distributed gather. A collective (every rank of `group` calls it): checks
    that the slices tile the heads in rank order and that every rank built the same set (method,
    layers), naming what differs. Returns the gather."""
    torch, dist = _torch()
    start, stop = (int(x) for x in head_slice)
    if not isinstance(caches, CacheSet):
        raise _kvslim.InputError(f"kvslim.distributed.shard: expected a kvslim.CacheSet, got {type(caches).__name__}")
    # This rank's own problems travel with the gather, so that every rank raises (none is left
    # waiting in a collective the others never join).
    problem = None
    for i, (attention, heads, _dim) in enumerate(caches._spec):
        if attention and heads != stop - start:
            problem = f"layer {i} holds {heads} KV heads but the slice [{start}, {stop}) has {stop - start}"
            break
        if attention and caches[i].stats()["tokens_seen"] != 0:
            problem = f"layer {i} already holds tokens: shard before the first update (or reset the set first)"
            break
    world = dist.get_world_size(group)
    mine = (start, stop, caches._method, tuple(caches._spec), problem)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    for rank, (*_, trouble) in enumerate(everyone):
        if trouble is not None:
            raise _kvslim.InputError(f"kvslim.distributed.shard: rank {rank}: {trouble}")
    check_slices([(s, e) for s, e, *_ in everyone], kv_heads)
    for rank, (_s, _e, method, layers, _p) in enumerate(everyone):
        if method != caches._method or len(layers) != len(caches._spec) or \
                [(a, d) for a, _h, d in layers] != [(a, d) for a, _h, d in caches._spec]:
            raise _kvslim.InputError(
                f"kvslim.distributed.shard: rank {rank} built a {method} set of {len(layers)} layers, this rank "
                f"({dist.get_rank(group)}) a {caches._method} set of {len(caches._spec)}: every rank needs the same "
                "method, layers and head_dim")
    gather = TensorParallel(group)
    caches.set_rank_gather(gather)
    return gather


class ModelLayout:
    """Where a tensor-parallel model's attention lives on this rank: its KV heads [start, stop) of
    kv_heads (and query heads [q_start, q_stop) of heads), the process group of the model's "tp"
    mesh dimension, this rank's place in it and the group's size."""

    def __init__(self, group, rank: int, world: int, kv_heads: int, heads: int):
        self.group, self.rank, self.world = group, rank, world
        self.kv_heads, self.heads = kv_heads, heads
        local_kv, local_q = kv_heads // world, heads // world
        self.start, self.stop = rank * local_kv, (rank + 1) * local_kv
        self.q_start, self.q_stop = rank * local_q, (rank + 1) * local_q

    @property
    def head_slice(self) -> tuple[int, int]:
        return self.start, self.stop

    def __repr__(self) -> str:
        return (f"ModelLayout(rank {self.rank} of {self.world}: KV heads [{self.start}, {self.stop}) of {self.kv_heads}, "
                f"query heads [{self.q_start}, {self.q_stop}) of {self.heads})")


def _tp_group(mesh):
    """The process group of a device mesh's "tp" dimension (transformers keeps a 1-D tp mesh, or a
    named mesh such as ("pp", "fsdp", "tp")); None (the default group) without a mesh."""
    if mesh is None:
        return None
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "tp" in names:
        return mesh["tp"].get_group()
    if getattr(mesh, "ndim", 1) == 1:
        return mesh.get_group()
    raise _kvslim.InputError(f"kvslim.distributed: the model's device mesh has dimensions {names or '(unnamed)'} and "
                             "none is named \"tp\": cannot tell which ranks share a layer's heads")


def model_layout(model, kv_heads: int, heads: int) -> ModelLayout | None:
    """The tensor-parallel layout transformers gave `model` (from_pretrained(..., tp_plan="auto")
    sets model._tp_size and model._device_mesh), or None for a model on one device. Checks it
    against the process group: the "tp" group's size must be the model's tp size, and the heads
    must split evenly (transformers' colwise shards give rank r the r-th contiguous slice of the
    q/k/v projections' output, so of the heads), naming what does not fit."""
    tp = getattr(model, "_tp_size", None)
    if tp is None or int(tp) <= 1:
        return None
    tp = int(tp)
    _torch_mod, dist = _torch()
    group = _tp_group(getattr(model, "_device_mesh", None))
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != tp:
        raise _kvslim.InputError(f"kvslim.distributed: the model is split over {tp} ranks (model._tp_size) but its "
                                 f"tensor-parallel process group has {world}")
    for what, n in (("KV heads", kv_heads), ("query heads", heads)):
        if n % world:
            raise _kvslim.InputError(f"kvslim.distributed: {n} {what} do not split over {world} tensor-parallel ranks "
                                     "(kvslim needs every rank to hold the same number of whole heads)")
    return ModelLayout(group, rank, world, kv_heads, heads)


__all__ = ["ModelLayout", "TensorParallel", "check_slices", "model_layout", "shard"]

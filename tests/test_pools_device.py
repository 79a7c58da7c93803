"""The token and request pools live on the device they are given (the served model passes the
device SGLang builds it on): every tensor follows it, and the pools' bookkeeping facts (sizes,
bytes) do not depend on it. ``meta`` stands in for an accelerator on a CPU-only machine."""

import torch

from cedar.backend.geometries import cedar_tiny
from cedar.backend.serving.pools import RequestSlots, TokenPools

CFG = cedar_tiny()


def _tensors(obj):
    for v in vars(obj).values():
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dict):
            for t in v.values():
                yield from ([t] if isinstance(t, torch.Tensor) else _tensors(t))


def test_every_pool_tensor_lives_on_the_given_device():
    for pools in (TokenPools(CFG, 512, "meta"), RequestSlots(CFG, 4, "meta")):
        tensors = list(_tensors(pools))
        assert len(tensors) >= 4 and {t.device.type for t in tensors} == {"meta"}, type(pools).__name__


def test_pool_sizes_do_not_depend_on_the_device():
    assert TokenPools(CFG, 512, "meta").nbytes == TokenPools(CFG, 512).nbytes > 0
    assert RequestSlots(CFG, 4, "meta").nbytes == RequestSlots(CFG, 4).nbytes > 0
    cpu = RequestSlots(CFG, 4)
    assert {t.device.type for t in _tensors(cpu)} == {"cpu"} and bool((cpu.ring_pos[0] == -1).all())

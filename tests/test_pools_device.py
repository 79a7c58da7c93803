"""The token and request pools live on the device they are given (the served model passes the
device SGLang builds it on): every tensor follows it, and the pools' bookkeeping facts (sizes,
bytes) do not depend on it. ``meta`` stands in for an accelerator on a CPU-only machine."""

import pytest
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


# ---------------------------------------------------------------------- the served step on meta
def _continuing_on_meta(positions):
    """A model, its pools, request slots and SGLang's slot table on ``meta`` (torch's default
    device stays the CPU), with one request per position whose slot state continues at it (as
    after its prefill: a decode step claims nothing)."""
    from cedar.backend.model_io import random_model
    from cedar.backend.serving.pools import SlotOwner
    from cedar.backend.serving.prefix_digest import PrefixHasher
    from cedar.kernels.dispatch import KernelSet
    from serving_harness import Harness

    model = random_model(CFG, seed=0).eval().use_kernels(KernelSet.for_device("meta")).to("meta")
    h = Harness(model, num_slots=4096, num_reqs=len(positions) + 1, max_len=1024, device="meta")
    reqs = []
    for i, H in enumerate(positions):
        req = h.admit(f"r{i}", i + 1, [3 + (i + p) % 50 for p in range(H + 8)])
        req.token_slots = h.alloc(req, H)
        h.slots.owners[req.slot] = SlotOwner(rid=req.rid, next_pos=H, decoder_pos=H,
                                             hasher=PrefixHasher(CFG.page_size))
        reqs.append(req)
    return h, reqs


def test_served_decode_step_keeps_every_tensor_on_the_pools_device():
    """The served decode step (the planner, tables, keys from the pools, the layers, the commit,
    the scattered output) with everything SGLang hands over on ``meta`` while torch's default
    device is the CPU: a tensor created on the default device would meet a pool tensor and the
    guard (which also refuses any read-back: meta tensors have no values) raises. Two steps put
    each request at both parities of the ratio-2 compression groups, some past the window."""
    from test_decode_step_sync_free import NoHostSync, decode_step

    assert torch.get_default_device().type == "cpu"
    h, reqs = _continuing_on_meta([37, 130, 255])
    for _ in range(2):
        guard = NoHostSync()
        logits = decode_step(h, reqs, guard=guard)
        assert guard.ops > 100
        assert logits.device.type == "meta" and logits.shape == (len(reqs), CFG.vocab_size)
    assert {t.device.type for t in _tensors(h.slots)} == {"meta"}
    assert [h.slots.owners[r.slot].next_pos for r in reqs] == [39, 132, 257]


def test_a_tensor_created_off_the_pools_device_fails_the_served_step(monkeypatch):
    """The test above can fail: the planner as it was (row positions created on torch's default
    device) is caught as a device mix inside the step."""
    from cedar.backend.serving import planner
    from test_decode_step_sync_free import HostSync, NoHostSync, decode_step

    class DefaultDeviceArange:
        def __getattr__(self, name):
            return getattr(torch, name)

        @staticmethod
        def arange(*args, device=None, **kwargs):
            return torch.arange(*args, **kwargs)

    monkeypatch.setattr(planner, "torch", DefaultDeviceArange())
    h, reqs = _continuing_on_meta([37])
    with pytest.raises(HostSync, match="mixes devices"):
        decode_step(h, reqs, guard=NoHostSync())

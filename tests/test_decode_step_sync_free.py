"""A served decode step never reads a tensor back to the host, never sizes a tensor from tensor
data, and never mixes devices: what a whole-step native call and a captured CUDA graph need.

"The decode step" is what ``CedarForCausalLM.forward`` runs for ``ForwardMode.DECODE`` after
SGLang hands over its batch: the token ids written to the pool, the planner (host bookkeeping
from SGLang's CPU-side lists: positions, slots), the tables, keys from the pools, the layers, the
commit and the scattered output (``served_step``). It runs here under :class:`NoHostSync`, a
dispatch mode that sees every ATen op (also those a composite op or a boolean index issues inside
ATen) and raises on the first one that reads a value back (``.item()``, ``int(t)``, ``bool(t)``,
``torch.equal``, ``.tolist()``, ``.numpy()``), sizes its output from tensor data (``nonzero``, a
boolean mask, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``) or
takes tensors on two devices. ``tests/test_pools_device.py`` runs the same step on ``meta``.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from cedar.backend.geometries import cedar_tiny
from cedar.backend.model_io import random_model
from cedar.backend.serving.driver import HostBatch, Mode
from cedar.backend.serving.runtime import StepInput
from cedar.kernels import cpu_ext
from cedar.kernels.dispatch import KernelSet
from serving_harness import Harness

CFG = cedar_tiny()
aten = torch.ops.aten


class HostSync(RuntimeError):
    """An op inside the guarded code reads a tensor back to the host or mixes devices."""


_READS_BACK = {aten._local_scalar_dense, aten.item, aten.equal, aten.is_nonzero, aten.nonzero, aten.argwhere,
               aten.masked_select, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
               aten.unique_dim_consecutive}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_, aten._unsafe_index}


class NoHostSync(TorchDispatchMode):
    """Raise :class:`HostSync` on any op that syncs the host with the device or mixes devices.

    ``ops`` counts the ops seen (a guard that saw nothing proves nothing). 0-dim CPU tensors (a
    wrapped Python scalar) may meet any device, as in ATen."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __enter__(self):
        self._saved = torch.Tensor.tolist, torch.Tensor.numpy

        def refuse(name):
            def call(t, *a, **k):
                raise HostSync(f"Tensor.{name}() reads a {t.device.type} tensor back to the host")
            return call

        torch.Tensor.tolist, torch.Tensor.numpy = refuse("tolist"), refuse("numpy")
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        packet = func.overloadpacket
        if packet in _READS_BACK:
            raise HostSync(f"{func} reads a tensor back to the host (or sizes its output from one)")
        if packet is aten.repeat_interleave and func is not aten.repeat_interleave.self_int \
                and kwargs.get("output_size") is None:
            raise HostSync(f"{func} without output_size sizes its output from the repeats")
        if packet in _INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                raise HostSync(f"{func} with a boolean mask: its shape depends on the mask's values")
        devices = {t.device for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
        if len(devices) > 1:
            raise HostSync(f"{func} mixes devices {sorted(str(d) for d in devices)}")
        return func(*args, **kwargs)


# ---------------------------------------------------------------------- the guard has teeth
@pytest.mark.parametrize("sync", [
    lambda x: x.sum().item(), lambda x: int(x[0]), lambda x: bool((x > 2).any()), lambda x: x.tolist(),
    lambda x: x.numpy(), lambda x: torch.nonzero(x), lambda x: x[x > 2], lambda x: torch.equal(x, x),
    lambda x: torch.repeat_interleave(x), lambda x: torch.unique(x), lambda x: x.masked_select(x > 2),
    lambda x: x[torch.arange(2)] if x.device.type == "meta" else x.to("meta")[torch.arange(2)],
    lambda x: torch.arange(5) + x.to("meta"),
], ids=["item", "int", "bool", "tolist", "numpy", "nonzero", "mask", "equal", "repeat_interleave", "unique",
        "masked_select", "index_with_cpu_indices", "binary_op_mix"])
def test_the_guard_refuses_every_kind_of_sync_and_device_mix(sync):
    x = torch.arange(5)
    with pytest.raises(HostSync), NoHostSync():
        sync(x)
    assert torch.Tensor.tolist(x) == [0, 1, 2, 3, 4]  # the patches are undone


def test_the_guard_lets_fixed_shape_device_work_through():
    x = torch.arange(6)
    with NoHostSync() as guard:
        y = torch.where(x > 2, x, -1)[torch.tensor([0, 5])]
        z = torch.repeat_interleave(x[:2], torch.tensor([1, 2]), output_size=3)
    assert guard.ops > 3 and torch.Tensor.tolist(y) == [-1, 5] and torch.Tensor.tolist(z) == [0, 1, 1]


# ---------------------------------------------------------------------- the decode step
def decode_step(h: Harness, reqs, guard: NoHostSync | None = None) -> torch.Tensor:
    """One decode step of ``reqs`` (each with one new token in ``req.ids``) as the served model
    runs it: SGLang's side (token slots allocated, its tables written, the ids and slots handed
    over as device tensors and host lists) unguarded, then the served forward under ``guard``.
    Returns the logits (B, vocab)."""
    out_loc, ids, prefix = [], [], []
    for req in reqs:
        H = len(req.token_slots)
        new = h.alloc(req, 1)
        req.token_slots += new
        h.req_to_token[req.slot, :len(req.token_slots)] = torch.tensor(req.token_slots)
        out_loc += new
        ids.append(req.ids[H])
        prefix.append(H)
    dev = h.pools.device
    out_cache_loc, input_ids = torch.tensor(out_loc, device=dev), torch.tensor(ids, device=dev)
    req_slots = torch.tensor([r.slot for r in reqs])
    fb = HostBatch(Mode(decode=True), [r.rid for r in reqs], req_slots, req_slots.to(dev),
                   torch.tensor(prefix) + 1, [], [], out_cache_loc)
    inp = StepInput.of(fb, h.rt.req_to_token)  # SGLang's host lists (its ``*_cpu`` tensors)
    with guard if guard is not None else torch.no_grad():
        with torch.no_grad():
            h.rt.write_ids(fb.out_cache_loc, input_ids)  # the rest of CedarRuntime.forward
            out = h.rt.step(input_ids, inp)
            return h.model.lm_head(out.hidden)


def _ids(n, seed):
    return torch.randint(3, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefilled(model):
    """Three requests prefilled (unguarded: a prefill is not a decode step) at lengths that put
    them at both parities of the ratio-2 groups and past the window."""
    h = Harness(model, num_reqs=4)
    reqs = [h.admit("a", 0, _ids(51, 1)), h.admit("b", 2, _ids(132, 2)), h.admit("c", 3, _ids(200, 3))]
    out, _ = h.step([(r, len(r.ids)) for r in reqs])
    for r in reqs:
        r.ids.append(int(out[r.rid][-1].argmax()))
    return h, reqs


@pytest.mark.skipif(not cpu_ext.available(), reason="the C++ CPU kernels could not be built here; the "
                    "batched-torch decode path runs sync-free on meta in test_pools_device.py")
def test_decode_step_reads_nothing_back_and_equals_the_unguarded_step():
    """Four decode steps of a batch of three (the served fast CPU path: C++ kernels reading the
    pools in place) under the guard: none syncs, and the logits are bit for bit those of the
    same steps unguarded (the guard only watches)."""
    model = random_model(CFG, seed=2).eval().use_kernels(KernelSet("fast"))
    guarded, plain = _prefilled(model), _prefilled(model)
    for step in range(4):
        guard = NoHostSync()
        logits = decode_step(*guarded, guard=guard)
        expect = decode_step(*plain)
        assert guard.ops > 100, "the guard saw the step"
        assert torch.equal(logits, expect), f"step {step}: the guarded step computed something else"
        for (h, reqs) in (guarded, plain):
            for r, row in zip(reqs, logits):
                r.ids.append(int(row.argmax()))
    # the commit's deferred prefix digests equal the unguarded ones once read (off the step)
    for a, b in zip(guarded[1], plain[1]):
        ha, hb = guarded[0].slots.owners[a.slot].hasher, plain[0].slots.owners[b.slot].hasher
        assert ha.boundaries == hb.boundaries and len(ha.boundaries) == 4


def test_decode_step_with_a_reintroduced_sync_fails(monkeypatch):
    """The test above can fail: a table built with a read-back (as the decode tables were, with
    ``torch.nonzero``) is caught inside the step."""
    from cedar.backend.serving import batch_tables

    model = random_model(CFG, seed=2).eval().use_kernels(KernelSet.for_device("cpu"))
    h, reqs = _prefilled(model)
    real = batch_tables.BatchTables.entries

    def entries_with_item(self, ratio, lag=0):
        int(self.seq_len.max())  # a read-back
        return real(self, ratio, lag)

    monkeypatch.setattr(batch_tables.BatchTables, "entries", entries_with_item)
    with pytest.raises(HostSync, match="_local_scalar_dense"):
        decode_step(h, reqs, guard=NoHostSync())

"""The stages of ``scripts/gpu_check.sh``: one GPU check for a machine with torch and Triton but no
SGLang and no network, each stage a separate process that writes its own JSON as it ends.

    python -m cedar.backend.gpu_stages STAGE OUTDIR [--dry-run]
    python -m cedar.backend.gpu_stages summary OUTDIR

Stages (file ``OUTDIR/<n>-<stage>.json``; ``status`` is ``pass``, ``fail`` (a comparison missed
its tolerance), ``skipped`` (with ``reason``: no CUDA, a module missing), ``error`` (with the
exception) or, written by the shell script, ``timeout`` / ``crashed``):

1. ``env``: torch / Triton versions, the device, which optional modules import (SGLang is not
   needed by any stage).
2. ``kernels``: each Triton kernel against its pure-torch twin at V4.1-Flash sizes (decode and
   prefill shapes of :mod:`gpu_check`), outputs compared and both timed.
3. ``served``: the served step (planner, pools, ``served_step``) on CUDA with the Triton kernels
   against the same step on the CPU with the torch twins: a cold prefill, a hit with bounded
   replay and greedy decode steps; greedy tokens equal, logits within the served tolerance.
4. ``replay``: 8 requests each hitting a 4k-token prefix (+16 new), replay folded into the batch's
   one forward (the default) against one replay forward per request (``replay_per_request``):
   the same logits, and the time of each.
5. ``graphs``: a batch-8 decode step with the encoder (embedding, layers before the cut, the cut)
   and the decoder (layers from the cut, norm, head) captured as two ``torch.cuda.CUDAGraph`` s,
   replayed, against the eager ``served_step``; a capture that fails is recorded with its error.

``--dry-run`` runs every stage on the CPU at tiny sizes (Triton under ``TRITON_INTERPRET=1``; the
CUDA side replaced by the CPU, the graph stage skipped) through the same code, in seconds.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

STAGES = ("env", "kernels", "served", "replay", "graphs")
ATOL = 2e-3  # the served tolerance (tests/test_serving_triton.py): quantized caches, last-bit code flips


def stage_file(out: Path, stage: str) -> Path:
    return out / f"{STAGES.index(stage) + 1}-{stage}.json"


@dataclass
class Ctx:
    """Where a stage runs: ``device`` the side under test, ``dry`` the CPU stand-in at tiny sizes."""

    dry: bool
    device: torch.device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _wall_ms(fn: Callable[[], object], ctx: Ctx, iters: int,
             setup: Callable[[], object] | None = None) -> float:
    """Median wall milliseconds of ``iters`` calls, the device drained around each (host work and
    launches included: what a served step costs); ``setup`` runs untimed before each call."""
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------- 1. environment


def stage_env(ctx: Ctx) -> dict:
    mods = {}
    for name in ("triton", "transformers", "sglang", "sgl_kernel"):
        if importlib.util.find_spec(name) is None:  # NOTE: found, not imported: SGLang's import is slow
            mods[name] = "absent"
        elif name == "triton":
            try:
                mods[name] = importlib.import_module(name).__version__
            except Exception as e:  # noqa: BLE001 - a broken module is a fact to report
                mods[name] = f"absent ({type(e).__name__}: {e})"
        else:
            mods[name] = "present"
    out = {"status": "pass", "python": platform.python_version(), "torch": torch.__version__,
           "modules": mods, "cuda_available": torch.cuda.is_available(),
           "triton_interpret": os.environ.get("TRITON_INTERPRET"), "device": str(ctx.device)}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device_name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                   multiprocessors=p.multi_processor_count, cuda=torch.version.cuda)
    if mods["triton"].startswith("absent"):
        out.update(status="fail", reason="Triton does not import: the kernel stages cannot run")
    return out


# ---------------------------------------------------------------- 2. kernels vs twins


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Float tensors: max |a - b| / max(1, max |b|) over the finite entries, inf where the two
    differ in which entries are infinite or NaN; integer codes: the fraction of differing ones."""
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    if a.dtype.is_floating_point:
        a, b = a.float(), b.float()
        fin = torch.isfinite(b)
        if not torch.equal(fin, torch.isfinite(a)) or not torch.equal(a[~fin].nan_to_num(0), b[~fin].nan_to_num(0)):
            return float("inf")
        if not fin.any():
            return 0.0
        return ((a[fin] - b[fin]).abs().max() / b[fin].abs().max().clamp_min(1.0)).item()
    return (a != b).float().mean().item()


def _outputs(op: str, result, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors an op produced: its return value, and for the scatters the codes written."""
    if op == "quantize_scatter_window":
        return {"codes": x["codes8"], "scales": x["scales8"]}
    if op == "quantize_scatter_global":
        return {"codes": x["codes4"], "scales": x["scales4"]}
    if op == "topk_select":  # NOTE: the order of equal scores is free: compare the chosen sets
        return {"indices": result.long().sort(dim=-1).values}
    if isinstance(result, tuple):
        return {f"out{i}": t for i, t in enumerate(result) if isinstance(t, torch.Tensor)}
    return {"out": result}


# per-op tolerance: float ops max |diff|; code tensors the fraction of codes allowed to differ
# (an fp8 / fp4 rounding tie can flip a last-bit code; the Triton interpreter's fp8 cast differs
# on ~2% of codes, see shared/notes/triton-cpu.md)
# (the kernels keep tl.dot in fp32, input_precision "ieee": float outputs differ by summation order)
KERNEL_TOL = {"window_attention": 1e-4, "indexer_scores": 1e-4, "topk_select": 0.0, "sparse_attention": 1e-4,
              "merge_states": 1e-4, "quantize_scatter_window": 0.01, "quantize_scatter_global": 0.01}
INTERPRETER_CODE_TOL = 0.05


def stage_kernels(ctx: Ctx) -> dict:
    from cedar.kernels import gpu_check as g

    if ctx.dry:
        geos = (g.GEOMETRIES[1],)  # cedar-tiny
        shapes = (g.Shape("decode-tiny", 2, 1, 64), g.Shape("prefill-tiny", 1, 16, 64))
    else:
        geos = (g.GEOMETRIES[0],)  # v4.1-flash: 64 heads, latent 512, 32 index heads x 128, top-512
        shapes = (g.Shape("decode-8k", 32, 1, 8192), g.Shape("prefill-8k", 1, 2048, 8192))
    rows, ok = [], True
    for geo in geos:
        for shape in shapes:
            torch.manual_seed(0)
            x = g.make_inputs(geo, shape, ctx.device)
            xk, xt = {k: v.clone() for k, v in x.items()}, {k: v.clone() for k, v in x.items()}
            kernels, twins = g.op_calls(geo, xk, "triton"), g.op_calls(geo, xt, "torch")
            for op in kernels:
                row = {"geometry": geo.name, "shape": shape.name, "op": op}
                try:
                    got, want = _outputs(op, kernels[op](), xk), _outputs(op, twins[op](), xt)
                    ctx.sync()
                    errs = {k: _close(got[k], want[k]) for k in want}
                    tol = KERNEL_TOL[op]
                    if ctx.dry and op.startswith("quantize"):
                        tol = INTERPRETER_CODE_TOL
                    row.update(max_err=errs, tol=tol, ok=all(e <= tol for e in errs.values()))
                    if not ctx.dry:
                        row["kernel_ms"] = g.time_ms(kernels[op])
                        row["twin_ms"] = g.time_ms(twins[op])
                        row["speedup"] = row["twin_ms"] / row["kernel_ms"]
                except Exception as e:  # noqa: BLE001 - one failing op must not hide the rest
                    row.update(ok=False, error=f"{type(e).__name__}: {e}"[:400])
                ok &= row["ok"]
                rows.append(row)
            del x, xk, xt, kernels, twins
            if ctx.device.type == "cuda":
                torch.cuda.empty_cache()
    return {"status": "pass" if ok else "fail", "checked": len(rows), "rows": rows,
            "mode": "interpreter" if ctx.dry else "native"}


# ---------------------------------------------------------------- the served path, without SGLang


def _driver(model, device, num_slots: int, num_reqs: int, max_len: int):
    """The runtime SGLang's model class calls, driven in process with SGLang's tables stood in
    for (``cedar.backend.serving.driver``)."""
    from cedar.backend.serving.driver import Driver

    return Driver(model, num_slots=num_slots, num_reqs=num_reqs, max_len=max_len, device=device)


def _step(d, batch, flags) -> torch.Tensor:
    """One served forward of ``batch`` (the runtime's step); each request's last row's logits (B, V)."""
    return d.last_logits(d.run(batch, flags=flags), batch)


def _req(rid: str, slot: int, ids: list[int], token_slots: list[int] | None = None):
    from cedar.backend.serving.driver import Req

    return Req(rid, slot, ids, token_slots or [])


def _hit(rid: str, slot: int, source, hit: int, new_ids: list[int]):
    return _req(rid, slot, source.ids[:hit] + list(new_ids), list(source.token_slots[:hit]))


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(8, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _model(cfg, device: torch.device, backend: str):
    from cedar.backend.model_io import random_model
    from cedar.kernels.dispatch import KernelSet

    return random_model(cfg, seed=7).eval().to(device).use_kernels(KernelSet(backend))


def _device_backend(ctx: Ctx) -> str:
    """The kernels of the side under test: Triton on a GPU; in a dry run the CPU's own kernels
    (C++ where they build, else the batched torch ops), since the served path under the Triton
    interpreter takes minutes (tests/test_serving_triton.py covers it)."""
    return "triton" if not ctx.dry else "fast"


def _served_cfg(ctx: Ctx):
    from cedar.backend.geometries import cedar_agent, cedar_tiny

    return cedar_tiny() if ctx.dry else cedar_agent()


# ---------------------------------------------------------------- 3. served step, device vs CPU


def _serve_script(model, device: torch.device, flags, sizes: dict, tokens: list[int] | None):
    """Cold prefills of B requests, then a hit with bounded replay on each (+``new`` tokens), then
    ``decode`` greedy steps of the hitters. ``tokens``: the decode tokens to feed (the reference's),
    else greedy from these logits. Returns (per-forward logits (B, V) on the CPU, tokens fed)."""
    B, L, hit, new, steps = sizes["batch"], sizes["prompt"], sizes["hit"], sizes["new"], sizes["decode"]
    V = model.cfg.vocab_size
    d = _driver(model, device, num_slots=2 * B * (L + new + steps) + 4096, num_reqs=2 * B, max_len=L + new + steps + 8)
    src = [_req(f"s{b}", b, _ids(L, 100 + b, V)) for b in range(B)]
    logits = [_step(d, [(r, L) for r in src], flags).cpu()]
    hitters = [_hit(f"h{b}", B + b, src[b], hit, _ids(new, 200 + b, V)) for b in range(B)]
    logits.append(_step(d, [(r, new) for r in hitters], flags).cpu())
    fed = []
    for s in range(steps):
        nxt = tokens[s * B:(s + 1) * B] if tokens is not None else logits[-1].argmax(-1).tolist()
        fed += nxt
        for r, t in zip(hitters, nxt):
            r.ids.append(int(t))
        logits.append(_step(d, [(r, 1) for r in hitters], flags).cpu())
    return torch.stack(logits), fed


def stage_served(ctx: Ctx) -> dict:
    from cedar.backend.serving.planner import ServingFlags

    cfg = _served_cfg(ctx)
    sizes = (dict(batch=2, prompt=170, hit=150, new=4, decode=2) if ctx.dry
             else dict(batch=4, prompt=1024, hit=900, new=16, decode=8))
    flags = ServingFlags(snapshot_mb=0, snapshots=False)
    t0 = time.perf_counter()
    ref_logits, ref_tokens = _serve_script(_model(cfg, torch.device("cpu"), "torch"), torch.device("cpu"), flags,
                                           sizes, None)
    t_ref = time.perf_counter() - t0
    backend = _device_backend(ctx)
    t0 = time.perf_counter()
    dev_logits, _ = _serve_script(_model(cfg, ctx.device, backend), ctx.device, flags, sizes, ref_tokens)
    t_dev = time.perf_counter() - t0
    err = (dev_logits - ref_logits).abs().amax(dim=(1, 2)).tolist()
    greedy_equal = bool((dev_logits.argmax(-1) == ref_logits.argmax(-1)).all())
    ok = max(err) <= ATOL and greedy_equal
    return {"status": "pass" if ok else "fail", "model": f"{cfg.name} (random weights)", "sizes": sizes,
            "device": str(ctx.device), "device_kernels": backend, "reference": "cpu, torch twins",
            "forwards": ["prefill", "hit+replay"] + ["decode"] * sizes["decode"],
            "max_abs_logit_err_per_forward": err, "tol": ATOL, "greedy_equal": greedy_equal,
            "wall_s": {"reference": round(t_ref, 2), "device": round(t_dev, 2)}}


# ---------------------------------------------------------------- 4. in-forward vs per-request replay


def stage_replay(ctx: Ctx) -> dict:
    from cedar.backend.serving.planner import ServingFlags

    cfg = _served_cfg(ctx)
    B, hit, new, trials = (2, 150, 4, 1) if ctx.dry else (8, 4096, 16, 5)
    backend = _device_backend(ctx)
    model = _model(cfg, ctx.device, backend)
    V = cfg.vocab_size
    modes = {"in_forward": ServingFlags(snapshot_mb=0, snapshots=False),
             "per_request": ServingFlags(snapshot_mb=0, snapshots=False, replay_per_request=True)}
    d = _driver(model, ctx.device, num_slots=B * (hit + 8) + 2 * len(modes) * (trials + 1) * B * (new + 8) + 4096,
               num_reqs=2 * B, max_len=hit + new + 8)
    src = [_req(f"s{b}", b, _ids(hit + 8, 300 + b, V)) for b in range(B)]
    with torch.no_grad():
        _step(d, [(r, len(r.ids)) for r in src], modes["in_forward"])
    news = [_ids(new, 400 + b, V) for b in range(B)]
    logits, times, replayed = {}, {m: [] for m in modes}, {}
    for t in range(trials + 1):  # trial 0: warm-up (Triton compiles), not timed
        for m, flags in modes.items():  # NOTE: the modes alternate
            hitters = [_hit(f"{m}{t}-{b}", B + b, src[b], hit, news[b]) for b in range(B)]
            ctx.sync()
            t0 = time.perf_counter()
            out = _step(d, [(r, new) for r in hitters], flags)
            ctx.sync()
            if t:
                times[m].append((time.perf_counter() - t0) * 1e3)
            logits[m] = out.cpu()
            replayed[m] = [d.slots.owners[B + b].replayed_tokens for b in range(B)]
    err = (logits["in_forward"] - logits["per_request"]).abs().max().item()
    greedy_equal = bool((logits["in_forward"].argmax(-1) == logits["per_request"].argmax(-1)).all())
    med = {m: sorted(v)[len(v) // 2] for m, v in times.items()}
    ok = err <= ATOL and greedy_equal and replayed["in_forward"] == replayed["per_request"] \
        and min(replayed["in_forward"]) > 0
    return {"status": "pass" if ok else "fail", "model": f"{cfg.name} (random weights)", "device": str(ctx.device),
            "kernels": backend, "batch": B, "hit": hit, "new": new, "replayed_rows": replayed,
            "max_abs_logit_err": err, "tol": ATOL, "greedy_equal": greedy_equal,
            "median_ms": med, "trials_ms": times,
            "per_request_over_in_forward": med["per_request"] / med["in_forward"]}


# ---------------------------------------------------------------- 5. CUDA graphs of the decode step


def _state_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable through the attributes and dicts of pools / slots (their state)."""
    seen = set() if seen is None else seen
    out = []
    items = obj.values() if isinstance(obj, dict) else vars(obj).values() if hasattr(obj, "__dict__") else ()
    for v in items:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
        elif isinstance(v, dict) or (hasattr(v, "__dict__") and type(v).__module__.startswith("cedar.")
                                     and not isinstance(v, type)):
            out += _state_tensors(v, seen)
    return out


def _copy_owners(owners: list) -> list:
    """Copies of SlotOwner records (their prefix hasher holds a hashlib object: no deepcopy)."""
    out = []
    for o in owners:
        h = o.hasher
        if h is not None:
            h = copy.copy(h)
            h.__dict__.update({k: v.copy() for k, v in vars(h).items() if hasattr(v, "copy")})
        out.append(dataclasses.replace(o, hasher=h))
    return out


class Checkpoint:
    """The device state of pools and slots and the host owners, to run one step twice from it."""

    def __init__(self, d) -> None:
        self.d = d
        self.tensors = _state_tensors(d.pools) + _state_tensors(d.slots)
        self.saved = [t.clone() for t in self.tensors]
        self.owners, self.next_slot = _copy_owners(d.slots.owners), d.next_slot
        self.r2t = d.req_to_token.clone()

    def restore(self) -> None:
        for t, s in zip(self.tensors, self.saved):
            t.copy_(s)
        self.d.slots.owners[:] = _copy_owners(self.owners)
        self.d.next_slot = self.next_slot
        self.d.req_to_token.copy_(self.r2t)


def _encoder(model, plan, keys):
    """Embedding, the layers before the cut and the cut, as ``CEDModel.run_layers`` runs them."""
    E, selections = model.cfg.decoder_start, {}
    h = model.embed(plan.input_ids)
    for layer in model.layers[:E]:
        h = model._block(layer, h, plan.batch, keys, selections)
    src = model.layers[E]
    keys.write_global(E, src.compressor, h, plan.batch)
    rope = plan.batch.rope(model.cfg.kv_latent_dim, model.cfg.rope_dim, model.cfg.rope_theta, model.fast)
    wk = keys.window_keys(E, src.window_kv(src.attn_norm(h), rope), plan.batch)
    return keys.decoder_rows(h, plan.batch), wk


def _decoder(model, plan, keys, dec, wk, num_rows: int) -> torch.Tensor:
    """The layers from the cut, the norm, the scatter of ``served_step`` and the head."""
    E, h, selections = model.cfg.decoder_start, dec.hidden, {}
    src = model.layers[E]
    for layer in model.layers[E:]:
        h = model._block(layer, h, dec.batch, keys, selections, wk if layer is src else None)
    hidden = torch.zeros(num_rows + 1, model.cfg.hidden_size, device=plan.input_ids.device)
    sched = plan.sched_index[dec.source_row.clamp_min(0)]
    ok = (dec.source_row >= 0) & (sched >= 0)
    hidden[torch.where(ok, sched, num_rows)] = model.norm(h)
    return model.lm_head(hidden[:num_rows]).float()


def stage_graphs(ctx: Ctx) -> dict:
    """Without CUDA (a dry run) everything up to the capture runs: the eager served decode step,
    its split into the two parts the graphs hold (which must compute the same logits), and the
    checkpoint the capture restores from; the status is then ``skipped``."""
    from cedar.backend.serving.planner import RequestInfo, ServingFlags, plan_forward
    from cedar.backend.serving.runtime import StepInput
    from cedar.backend.serving.pool_keys import PoolKeys
    from cedar.backend.serving.step import served_step

    cfg = _served_cfg(ctx)
    backend = "triton" if ctx.device.type == "cuda" else _device_backend(ctx)
    model = _model(cfg, ctx.device, backend)
    flags = ServingFlags(snapshot_mb=0, snapshots=False)
    B, L, iters = (8, 512, 50) if not ctx.dry else (2, 150, 2)
    V = cfg.vocab_size
    d = _driver(model, ctx.device, num_slots=B * (L + 64) + 4096, num_reqs=B, max_len=L + 64)
    reqs = [_req(f"r{b}", b, _ids(L, 500 + b, V)) for b in range(B)]
    with torch.no_grad():
        first = _step(d, [(r, L) for r in reqs], flags)
    for r, t in zip(reqs, first.argmax(-1).tolist()):
        r.ids.append(t)

    base = [list(r.token_slots) for r in reqs]

    def plan_decode():  # NOTE: always the same step: from the prefilled state, one token each
        for r, b in zip(reqs, base):
            r.token_slots = list(b)
        fb, input_ids = d.prepare([(r, 1) for r in reqs])
        d.rt.write_ids(fb.out_cache_loc, input_ids)
        inp = StepInput.of(fb, d.req_to_token)
        return plan_forward(cfg, flags, d.slots, d.pools, d.req_to_token, inp.rids, inp.req_slots, inp.prefix_lens,
                            inp.extend_lens, input_ids, [RequestInfo()] * B)

    out: dict = {"model": f"{cfg.name} (random weights)", "batch": B, "context": L, "kernels": backend,
                 "tables": "built eagerly before capture (host planning from SGLang's lists); "
                           "the graphs hold the device work of the step"}
    ckpt = Checkpoint(d)
    with torch.no_grad():
        # eager: the served step itself, and its time (planning and tables included)
        plan = plan_decode()
        eager = model.lm_head(served_step(model, d.pools, d.slots, plan, B)[0]).float()
        ckpt_after = [t.clone() for t in ckpt.tensors]

        def eager_step():
            p = plan_decode()
            return model.lm_head(served_step(model, d.pools, d.slots, p, B)[0])

        def plan_and_tables():
            return PoolKeys(cfg, model.codec, d.pools, d.slots, plan_decode())

        # NOTE: each timed step starts from the checkpoint (restored untimed): the same step again
        out["eager_step_ms"] = _wall_ms(eager_step, ctx, iters, setup=ckpt.restore)
        out["plan_and_tables_ms"] = _wall_ms(plan_and_tables, ctx, iters, setup=ckpt.restore)
        ckpt.restore()
        plan = plan_decode()
        keys = PoolKeys(cfg, model.codec, d.pools, d.slots, plan)
        split = _decoder(model, plan, keys, *_encoder(model, plan, keys), B)  # eager split: also warms up
        out["split_max_abs_logit_err"] = (split - eager).abs().max().item()
        split_state = all(torch.equal(t, s) for t, s in zip(ckpt.tensors, ckpt_after))
        out["split_state_equals_served_step"] = split_state
        split_ok = out["split_max_abs_logit_err"] <= ATOL and split_state
        if ctx.device.type != "cuda":
            return {**out, "status": "skipped" if split_ok else "fail",
                    "reason": "skipped: no CUDA (the eager split and checkpoint were checked; no capture)"}
        ckpt.restore()
        plan = plan_decode()
        pre = [t.clone() for t in ckpt.tensors]  # the token ids of this step written

        def back_to_pre():
            for t, s in zip(ckpt.tensors, pre):
                t.copy_(s)

        g_enc, g_dec = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        stage = "encoder"
        try:
            with torch.cuda.stream(stream):  # a warm-up on the capture stream, as torch's docs ask
                keys = PoolKeys(cfg, model.codec, d.pools, d.slots, plan)
                _decoder(model, plan, keys, *_encoder(model, plan, keys), B)
            torch.cuda.current_stream().wait_stream(stream)
            back_to_pre()
            # NOTE: fresh keys, so views the warm-up cached are built inside the capture
            keys = PoolKeys(cfg, model.codec, d.pools, d.slots, plan)
            torch.cuda.synchronize()
            with torch.cuda.graph(g_enc):
                dec, wk = _encoder(model, plan, keys)
            stage = "decoder"
            with torch.cuda.graph(g_dec):
                logits = _decoder(model, plan, keys, dec, wk, B)
        except Exception as e:  # noqa: BLE001 - why it cannot be captured is the finding
            out.update(status="fail", capture_failed=stage, error=f"{type(e).__name__}: {e}"[:800],
                       traceback=traceback.format_exc()[-2000:])
            return out
        back_to_pre()
        g_enc.replay()
        g_dec.replay()
        torch.cuda.synchronize()
        err = (logits - eager).abs().max().item()
        state_equal = all(torch.equal(t, s) for t, s in zip(ckpt.tensors, ckpt_after))
        out.update(max_abs_logit_err=err, tol=ATOL, state_after_equals_eager=state_equal,
                   greedy_equal=bool((logits.argmax(-1) == eager.argmax(-1)).all()))
        out["status"] = "pass" if split_ok and err <= ATOL and out["greedy_equal"] and state_equal else "fail"
        # NOTE: each replay from the state before the step (restored untimed): a second replay on
        # the advanced state would fail the compressor-tail check (a device assert)
        try:
            out["graph_replay_ms"] = _wall_ms(lambda: (g_enc.replay(), g_dec.replay()), ctx, iters,
                                              setup=back_to_pre)
            out["encoder_replay_ms"] = _wall_ms(g_enc.replay, ctx, iters, setup=back_to_pre)
            out["decoder_replay_ms"] = _wall_ms(g_dec.replay, ctx, iters,
                                                setup=lambda: (back_to_pre(), g_enc.replay()))
        except Exception as e:  # noqa: BLE001 - keep the comparison above
            out.update(status="fail", timing_error=f"{type(e).__name__}: {e}"[:800])
            return out
    # what a served step with the graphs costs: the host planning and tables, then the replays
    out["graph_step_ms"] = out["plan_and_tables_ms"] + out["graph_replay_ms"]
    out["eager_over_graph"] = out["eager_step_ms"] / out["graph_step_ms"]
    return out


# ---------------------------------------------------------------- driver


RUNNERS: dict[str, Callable[[Ctx], dict]] = {"env": stage_env, "kernels": stage_kernels, "served": stage_served,
                                             "replay": stage_replay, "graphs": stage_graphs}


def run_stage(stage: str, out: Path, dry: bool) -> dict:
    """Run one stage and write its JSON (also when it raises: status ``error``, or ``skipped``
    when a module it needs is missing)."""
    cuda = torch.cuda.is_available() and not dry
    ctx = Ctx(dry=dry, device=torch.device("cuda" if cuda else "cpu"))
    t0 = time.perf_counter()
    if not cuda and not dry and stage != "env":
        result = {"status": "skipped", "reason": "no CUDA device (run with --dry-run on a CPU)"}
    else:
        try:
            result = RUNNERS[stage](ctx)
        except ModuleNotFoundError as e:
            result = {"status": "skipped", "reason": f"module missing: {e.name}", "error": str(e)}
        except Exception as e:  # noqa: BLE001 - the script goes on to the next stage
            result = {"status": "error", "error": f"{type(e).__name__}: {e}"[:800],
                      "traceback": traceback.format_exc()[-3000:]}
    result = {"stage": stage, "dry_run": dry, **result, "elapsed_s": round(time.perf_counter() - t0, 2)}
    out.mkdir(parents=True, exist_ok=True)
    stage_file(out, stage).write_text(json.dumps(result, indent=1, default=str))
    return result


def summarize(out: Path) -> dict:
    """summary.json: each stage's status (``missing`` if its file is absent) and headline figures."""
    stages = {}
    for s in STAGES:
        f = stage_file(out, s)
        r = json.loads(f.read_text()) if f.exists() else {"status": "missing"}
        keep = ("status", "reason", "error", "elapsed_s", "device_name", "torch", "max_abs_logit_err",
                "median_ms", "eager_step_ms", "graph_replay_ms", "eager_over_graph", "capture_failed", "checked")
        stages[s] = {k: r[k] for k in keep if k in r}
    summary = {"stages": stages, "all_passed": all(v["status"] in ("pass", "skipped") for v in stages.values())}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=STAGES + ("summary",))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreted")
    args = parser.parse_args(argv)
    if args.stage == "summary":
        s = summarize(args.out)
        for name, v in s["stages"].items():
            print(f"  {name:<8} {v['status']:<8} {v.get('reason') or v.get('error') or ''}")
        return 0 if s["all_passed"] else 1
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_stages: --dry-run needs TRITON_INTERPRET=1 set before Python starts", file=sys.stderr)
        return 2
    r = run_stage(args.stage, args.out, args.dry_run)
    brief = {k: r[k] for k in ("status", "reason", "error", "elapsed_s") if k in r}
    print(f"[{args.stage}] {json.dumps(brief)}")
    return 0 if r["status"] in ("pass", "skipped") else 1


if __name__ == "__main__":
    sys.exit(main())

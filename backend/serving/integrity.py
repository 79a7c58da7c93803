"""Pool integrity as the scheduler sees it (:func:`pool_integrity`), and Cedar's own request-slot
and snapshot invariants (:func:`slot_integrity`).

Pools: every token slot is free, cached in the radix tree
(evictable), protected by a running request's prefix, or private to a running request; every
request slot is free or held. The figures are read through SGLang 0.5.23's own pool-stats
observer and invariant checker by the state hook (:mod:`sglang_hooks`, where those reads are
pinned by the drift test); this module only judges them."""

from __future__ import annotations


def pool_integrity(tokens: dict[str, int], request_slots: dict[str, int]) -> dict:
    """SGLang's accounting judged: tokens {total, free, cached, protected, in_use, session_held}
    must add up to the total. The figures are read off the scheduler by the state hook."""
    accounted = sum(v for k, v in tokens.items() if k != "total")
    return {"tokens": tokens, "tokens_ok": accounted == tokens["total"], "request_slots": request_slots}


def slot_integrity(slots, snapshots, running: dict[int, str] | None = None) -> list[str]:
    """Every broken invariant of Cedar's private state, as messages (empty: all hold).

    Per request slot with an owner: window_floor <= decoder_pos <= next_pos; every tagged ring
    row sits at its position's ring index (pos % S) and belongs to the owner's rows (encoder
    layers and layer E [window_floor, next_pos), later layers below decoder_pos); kept encoder outputs
    likewise (pos % W, below next_pos); each compressor tail holds next_pos % r rows. Snapshots:
    their bytes add up within the budget, every key names a kept snapshot. running: {slot: rid}
    of the scheduler's running requests; each slot's owner must be that request."""
    cfg, bad = slots.cfg, []
    for slot, o in enumerate(slots.owners):
        if o.rid is None:
            continue
        if not (o.window_floor <= o.decoder_pos <= o.next_pos):
            bad.append(f"slot {slot}: floor {o.window_floor}, decoder {o.decoder_pos}, next {o.next_pos}")
        for layer, ring in slots.ring_pos.items():
            tags = ring[slot]
            idx = (tags >= 0).nonzero().flatten()
            top = o.decoder_pos if layer > cfg.decoder_start else o.next_pos  # E writes every row
            pos = tags[idx]
            if bool((pos % tags.numel() != idx).any() | (pos < o.window_floor).any() | (pos >= top).any()):
                bad.append(f"slot {slot} layer {layer}: ring tags {pos.tolist()} outside "
                           f"[{o.window_floor}, {top}) or off their ring index")
        enc = slots.enc_pos[slot]
        idx = (enc >= 0).nonzero().flatten()
        if bool((enc[idx] % enc.numel() != idx).any() | (enc[idx] >= o.next_pos).any()):
            bad.append(f"slot {slot}: encoder outputs {enc[idx].tolist()} off their index or beyond {o.next_pos}")
        for s, tail in slots.tail_len.items():
            if int(tail[slot]) != o.next_pos % cfg.compress_ratios[s]:
                bad.append(f"slot {slot} source {s}: compressor tail {int(tail[slot])} != {o.next_pos} % ratio")
    for slot, rid in (running or {}).items():
        if slots.owners[slot].rid != rid:
            bad.append(f"slot {slot}: running {rid!r} but owned by {slots.owners[slot].rid!r}")
    if snapshots is not None:
        bad += snapshots.check()
    return bad

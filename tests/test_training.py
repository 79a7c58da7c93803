"""The batched training forward against the reference model, and the training loop: the loss
falls, an interrupted run resumes to the same weights, packing places every token once."""

import json

import numpy as np
import pytest
import torch

from cedar.backend import replay
from cedar.backend.cache import cache_for_hit, new_cache
from cedar.backend.geometries import cedar_tiny
from cedar.backend.model import CEDModel
from cedar.backend.model_io import random_model
from cedar.training.dense import DenseForward, Plan
from cedar.training.trainer import TrainConfig, pack_rows, step_plan, train

W = 128


@pytest.fixture(scope="module")
def ref():
    cfg = cedar_tiny()
    model = CEDModel(cfg, quantize=False)
    model.load_state_dict(random_model(cfg, 3).state_dict())
    return model.eval()


def test_cold_rows_match_the_reference_forward(ref):
    ids = torch.randint(8, 512, (2, 384), generator=torch.Generator().manual_seed(0))
    doc = torch.zeros(2, 384, dtype=torch.long)
    with torch.no_grad():
        logits, _ = DenseForward(ref).run(ids, doc, Plan())
        for b in range(2):
            torch.testing.assert_close(logits[b], ref.forward(ids[b]), atol=2e-5, rtol=1e-5)


def test_a_simulated_hit_and_narrowed_prompt_match_served_replay(ref):
    """Rows of pass 2 equal the reference's bounded-replay prefill (narrowed: its last W rows)
    and the decode steps after it."""
    H, P, T = 256, 384, 512
    ids = torch.randint(8, 512, (1, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = DenseForward(ref).run(ids, torch.zeros(1, T, dtype=torch.long), Plan(hit=H, narrow_end=P))
        donor = new_cache(ref.cfg, False)
        replay.prefill(ref, donor, ids[0, :H], replay.replay_span(0, W))
        cache = cache_for_hit(donor, ref.cfg, H, False)
        res = replay.prefill(ref, cache, ids[0, :P], replay.replay_span(H, W), narrow=True)
        assert res.positions.tolist() == list(range(P - W, P))
        torch.testing.assert_close(logits[0, P - W:P], res.logits, atol=2e-5, rtol=1e-5)
        steps = torch.stack([replay.decode(ref, cache, int(ids[0, t])) for t in range(P, P + 24)])
        torch.testing.assert_close(logits[0, P:P + 24], steps, atol=2e-5, rtol=1e-5)
        # and the simulation is not a no-op: the cold rows differ from the replayed ones
        cold, _ = DenseForward(ref).run(ids, torch.zeros(1, T, dtype=torch.long), Plan())
        assert (cold[0, P - W:P] - logits[0, P - W:P]).abs().max() > 1e-3


def test_documents_in_one_row_do_not_see_each_other(ref):
    a = torch.randint(8, 512, (200,), generator=torch.Generator().manual_seed(2))
    b = torch.randint(8, 512, (184,), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([a, b])[None]
    doc = torch.cat([torch.zeros(200, dtype=torch.long), torch.ones(184, dtype=torch.long)])[None]
    with torch.no_grad():
        logits, _ = DenseForward(ref).run(ids, doc, Plan())
        torch.testing.assert_close(logits[0, :200], ref.forward(a), atol=2e-5, rtol=1e-5)
        # the second document is shifted by 200 positions: RoPE makes that invisible
        torch.testing.assert_close(logits[0, 200:], ref.forward(b), atol=2e-4, rtol=1e-4)


def test_the_indexer_and_compressors_get_gradients(ref):
    model = CEDModel(ref.cfg, quantize=False)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(8, 512, (1, 256), generator=torch.Generator().manual_seed(4))
    logits, aux = DenseForward(model, aux_stride=1).run(ids, torch.zeros(1, 256, dtype=torch.long), Plan())
    (logits.logsumexp(-1).mean() + aux).backward()
    assert float(aux.detach()) > 0
    for name in ("layers.1.wq_index.weight", "layers.6.wq_index.weight", "layers.1.compressor.wk_index.weight",
                 "layers.4.compressor.wkv.weight", "layers.1.compressor.wgate.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and float(grad.abs().sum()) > 0, name


def test_packing_places_every_token_once_at_even_offsets():
    rng = np.random.default_rng(0)
    lens = rng.integers(3, 700, size=300)
    starts = np.concatenate([[0], np.cumsum(lens)])
    rows = pack_rows(starts, 512)
    covered = sorted(r for row in rows for r in row)
    assert sum(b - a for a, b in covered) == int(lens.sum())
    assert all(b2 == a1 for (_, b2), (a1, _) in zip(covered, covered[1:])) and covered[0][0] == 0
    for row in rows:
        assert sum(b - a + (b - a) % 2 for a, b in row) <= 512


def test_step_plans_mix_replay_narrowing_and_plain_steps():
    tc = TrainConfig(steps=400, seed=0)
    plans = [step_plan(tc, s, 1536, W) for s in range(400)]
    assert plans == [step_plan(tc, s, 1536, W) for s in range(400)]
    hits = [p for p in plans if p.hit]
    assert 0.25 < len(hits) / 400 < 0.45 and all(2 * W <= p.hit < p.narrow_end <= 1536 for p in hits)
    assert 0.15 < sum(1 for p in plans if p.narrow_end and not p.hit) / 400 < 0.35
    assert any(not p.hit and not p.narrow_end for p in plans)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """Where small_corpus writes its tokenizer."""
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module")
def small_corpus(corpus_dir):
    from cedar.training.corpus.build import build_corpus, tokenize_corpus
    from cedar.backend.tokenizer import build_tokenizer, special_token_ids

    out = corpus_dir
    corpus = build_corpus(seed=5, scale=0.004, log=None)
    build_tokenizer(out, 512, corpus=[s["text"] for s in corpus.sessions], markup_tokens=True)
    arrays = tokenize_corpus(corpus.sessions, out)
    ids = special_token_ids(out)
    return arrays, cedar_tiny(bos=ids["<|bos|>"], pad=ids["<|pad|>"])


def test_a_short_training_run_lowers_the_loss_and_resumes_exactly(small_corpus, corpus_dir, tmp_path):
    from cedar.training.probes import ProbeConfig, ProbeSuite

    arrays, cfg = small_corpus
    tc = TrainConfig(steps=16, batch=2, seq_len=256, warmup=2, lr=3e-3, checkpoint_every=100, eval_every=8)
    probes = ProbeSuite(cfg, ProbeConfig(gaps=(0, 200), cases=2, distances=(64,)), tokenizer_dir=corpus_dir)
    torch.set_num_threads(2)
    model, curve = train(cfg, arrays, None, tc, tmp_path / "a", progress=False, probes=probes)
    losses = [p["loss"] for p in curve["train"]]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.5, losses
    assert (tmp_path / "a" / "loss_curve.png").stat().st_size > 0
    # the probes ran at each eval (steps 8 and 16) and are in the curve
    assert [p["step"] for p in curve["probes"]] == [8, 16]
    for p in curve["probes"]:
        assert set(p["repeat"]) == {"0", "200"} and set(p["value"]) == {"64"}
        assert set(p["recall"]) == {"L1", "L4", "L6"} and all(0 <= v <= 1 for v in p["repeat"].values())
    assert json.loads((tmp_path / "a" / "loss_curve.json").read_text())["probes"] == curve["probes"]
    _, half = train(cfg, arrays, None, tc, tmp_path / "b", progress=False, until=7, probes=probes)
    assert len(half["train"]) == 7
    resumed, curve_b = train(cfg, arrays, None, tc, tmp_path / "b", progress=False, probes=probes)
    assert [p["loss"] for p in curve_b["train"]] == losses
    same = lambda ps: [{k: v for k, v in p.items() if k != "seconds"} for p in ps]  # noqa: E731
    assert same(curve_b["probes"]) == same(curve["probes"])  # same weights, same figures
    for (name, p), q in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name


def test_cedar_train_writes_a_model_folder_and_resumes(tmp_path):
    import json
    import subprocess
    import sys

    from cedar.backend.model_io import load_model

    cmd = [sys.executable, "-m", "cedar.cli", "train", "--out", str(tmp_path), "--steps", "4", "--batch", "1",
           "--seq-len", "256", "--scale", "0.003", "--eval-every", "2", "--checkpoint-every", "2", "--no-progress",
           "--probe-quick"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    model = load_model(tmp_path / "model")
    assert model.cfg.vocab_size == 2048 and model.cfg.name == "cedar-agent"
    curve = json.loads((tmp_path / "loss_curve.json").read_text())
    assert len(curve["train"]) == 4 and [p["step"] for p in curve["heldout"]] == [2, 4]
    assert (tmp_path / "loss_curve.png").stat().st_size > 0
    summary = json.loads((tmp_path / "model" / "training.json").read_text())
    assert summary["steps"] == 4 and summary["command"].startswith("cedar train --out")
    # the probes of every eval, in the curve and in training.json
    assert [p["step"] for p in curve["probes"]] == [2, 4] and summary["probes"] == curve["probes"]
    assert set(curve["probes"][0]["repeat"]) == {"0", "200"} and set(curve["probes"][0]["value"]) == {"32", "256"}
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # resumes at step 4: nothing left
    assert again.returncode == 0 and json.loads((tmp_path / "loss_curve.json").read_text())["train"] == curve["train"]
    # the probes alone on a model folder, and a clear error for a folder that holds none
    probe = [sys.executable, "-m", "cedar.cli", "train", "--probe-only", str(tmp_path / "model"), "--json",
             str(tmp_path / "probes.json"), "--probe-quick"]
    res = subprocess.run(probe, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    report = json.loads((tmp_path / "probes.json").read_text())
    assert report["repeat"] == curve["probes"][-1]["repeat"] and report["value"] == curve["probes"][-1]["value"]
    bad = subprocess.run(probe[:5] + [str(tmp_path / "nothing")], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "cannot load" in bad.stderr


def test_bf16_training_lowers_the_loss_and_tracks_f32(small_corpus, tmp_path):
    arrays, cfg = small_corpus
    base = dict(steps=12, batch=2, seq_len=256, warmup=2, lr=3e-3, checkpoint_every=100, eval_every=100)
    torch.set_num_threads(2)
    _, f32 = train(cfg, arrays, None, TrainConfig(**base), tmp_path / "f32", progress=False)
    _, bf16 = train(cfg, arrays, None, TrainConfig(**base, bf16=True), tmp_path / "bf16", progress=False)
    a, b = [p["loss"] for p in f32["train"]], [p["loss"] for p in bf16["train"]]
    assert np.mean(b[-3:]) < np.mean(b[:3]) - 0.3, b
    assert a != b  # the matmuls did run in bfloat16
    assert abs(a[0] - b[0]) < 0.05 and abs(np.mean(a[-3:]) - np.mean(b[-3:])) < 0.25, (a, b)


def test_a_warm_start_begins_from_the_given_weights(small_corpus, tmp_path):
    from cedar.backend.model_io import save_model

    arrays, cfg = small_corpus
    warm = random_model(cfg, 11)
    (tmp_path / "warm").mkdir()
    save_model(warm, tmp_path / "warm")
    tc = TrainConfig(steps=1, batch=1, seq_len=256, warmup=1, lr=0.0, min_lr=0.0, checkpoint_every=100,
                     eval_every=100, init=str(tmp_path / "warm"))
    model, curve = train(cfg, arrays, None, tc, tmp_path / "run", progress=False)
    for (name, p), q in zip(model.state_dict().items(), warm.state_dict().values()):
        assert torch.equal(p, q.float()), name
    cold, _ = train(cfg, arrays, None, TrainConfig(**{**tc.__dict__, "init": ""}), tmp_path / "cold", progress=False)
    assert not torch.equal(cold.embed_tokens.weight, model.embed_tokens.weight)


def test_copy_rows_repeat_random_strings_and_train_only_the_repeats():
    from cedar.training.trainer import UNTRAINED, copy_row

    tc = TrainConfig(copy_share=0.5)
    ids, doc, w = copy_row(tc, 7, 512)
    assert torch.equal(ids, copy_row(tc, 7, 512)[0]) and not torch.equal(ids, copy_row(tc, 8, 512)[0])
    docs = sorted(set(doc.tolist()) - {-1})
    assert len(docs) >= 3
    for d in docs:
        at = (doc == d).nonzero()[:, 0]
        assert int(at[0]) % 2 == 0
        x, wd = ids[at], w[at]
        n = int((wd == UNTRAINED).sum())  # the first statement
        assert 8 <= n <= 48 and bool((wd[:n] == UNTRAINED).all()) and bool((wd[n:] == 1).all())
        assert len(x) % n == 0 and torch.equal(x, x[:n].repeat(len(x) // n))
        assert int(x.min()) >= 8 and int(x.max()) < 2046


def test_recall_rows_repeat_earlier_strings_at_every_distance_and_train_only_what_can_be_copied():
    """Each trained token is the next token of a string stated earlier in the row (so copying
    predicts it), the strings' first statements and each repeat's first token carry no loss,
    and repeats reach back past the window."""
    from cedar.training.trainer import UNTRAINED, recall_row

    tc = TrainConfig(recall_share=1.0)
    ids, doc, w = recall_row(tc, 3, 1024)
    assert torch.equal(ids, recall_row(tc, 3, 1024)[0]) and not torch.equal(ids, recall_row(tc, 4, 1024)[0])
    assert set(doc.tolist()) <= {0, -1} and int((doc == 0).sum()) > 900
    ids_l, w_l = ids.tolist(), w.tolist()
    trained = [t for t in range(1, len(ids_l)) if w_l[t] == 1]
    assert len(trained) > 200 and all(w_l[t - 1] != 0 for t in trained)
    far = 0
    for t in trained:
        # the bigram (previous, this) occurred before, untrained-first-statement included
        seen = [s for s in range(1, t)
                if ids_l[s - 1] == ids_l[t - 1] and ids_l[s] == ids_l[t] and w_l[s] == UNTRAINED]
        assert seen, f"token {t} copies nothing stated before"
        far += t - seen[-1] > 128
    assert far > 50  # repeats beyond the 128-token window


def test_keyed_rows_answer_each_query_with_the_value_stated_for_its_key():
    """A keyed row's queries name a key stated earlier (often beyond the window) and are answered
    with that key's value; only the answers carry loss, their first id as VALUE_START."""
    from cedar.training.trainer import UNTRAINED, VALUE_START, keyed_row

    tc = TrainConfig(keyed_share=1.0)
    ids, doc, w = keyed_row(tc, 5, 2048)
    assert torch.equal(ids, keyed_row(tc, 5, 2048)[0]) and not torch.equal(ids, keyed_row(tc, 6, 2048)[0])
    ids_l, w_l = ids.tolist(), w.tolist()
    n = int((doc >= 0).sum())
    ends = [i for i in range(n) if w_l[i] != UNTRAINED and (i + 1 == n or w_l[i + 1] == UNTRAINED)]
    starts = [i for i in range(n) if w_l[i] == VALUE_START]
    assert len(starts) > 40 and len(starts) == len(ends)
    text = ids_l[:n]
    far = 0
    for v, e in zip(starts, ends):
        eq = v - 1
        assert w_l[eq] == 0 and w_l[v + 1:e + 1] == [1] * (e - v)
        k = eq
        while k > 0 and w_l[k - 1] == UNTRAINED and text[k - 1] != text[e]:
            k -= 1
        key, answer = text[k:eq + 1], text[v:e + 1]
        # the same key, with every weight UNTRAINED, was stated before with this very answer
        hits = [i for i in range(k) if text[i:i + len(key)] == key and text[i + len(key):i + len(key) + len(answer)] == answer
                and all(x == UNTRAINED for x in w_l[i:i + len(key) + len(answer)])]
        assert hits, f"query at {k} answers with a value never stated for its key"
        far += k - hits[-1] > 128
    assert far > 20  # lookups beyond the 128-token window


def _loss_case(cfg):
    """A random model's forward and one 256-token row of random ids, every token an assistant's."""
    ids = torch.randint(8, 500, (1, 256), generator=torch.Generator().manual_seed(1))
    return (DenseForward(random_model(cfg, 2)), ids, torch.zeros(1, 256, dtype=torch.long),
            torch.ones(1, 256, dtype=torch.uint8))


def test_value_start_tokens_are_weighed_by_value_start_weight(small_corpus):
    from cedar.training.trainer import VALUE_START, loss_of

    fwd, ids, doc, w = _loss_case(small_corpus[1])
    w[0, 100:110] = VALUE_START
    with torch.no_grad():
        even, _ = loss_of(fwd, ids, doc, w, Plan(), TrainConfig(aux_weight=0.0))
        plain, _ = loss_of(fwd, ids, doc, torch.ones_like(w), Plan(), TrainConfig(aux_weight=0.0, value_start_weight=5.0))
        up, _ = loss_of(fwd, ids, doc, w, Plan(), TrainConfig(aux_weight=0.0, value_start_weight=5.0))
        changed = ids.clone()
        changed[0, 100:110] = 7  # the weighed-up targets: only they move the loss
        up2, _ = loss_of(fwd, changed, doc, w, Plan(), TrainConfig(aux_weight=0.0, value_start_weight=5.0))
        even2, _ = loss_of(fwd, changed, doc, w, Plan(), TrainConfig(aux_weight=0.0))
    assert torch.isclose(even, plain)  # weight 1.0: a VALUE_START token is an assistant token
    assert not torch.isclose(up, even)
    # changing the weighed-up targets moves the objective more once they weigh 5x
    assert abs(float(up2 - up)) > abs(float(even2 - even)) * 2


def test_untrained_tokens_carry_no_loss(small_corpus):
    from cedar.training.trainer import UNTRAINED, loss_of

    fwd, ids, doc, w = _loss_case(small_corpus[1])
    tc = TrainConfig(aux_weight=0.0)
    with torch.no_grad():
        full, _ = loss_of(fwd, ids, doc, w, Plan(), tc)
        w2 = w.clone()
        w2[0, 128:] = UNTRAINED
        half, plain = loss_of(fwd, ids, doc, w2, Plan(), tc)
        changed = ids.clone()
        changed[0, 129:] = 9  # the untrained targets' values do not matter
        same, _ = loss_of(fwd, changed, doc, w2, Plan(), tc)
    assert not torch.isclose(full, half) and torch.isclose(half, same)


def test_bf16_is_refused_where_the_cpu_only_emulates_it(monkeypatch, tmp_path, capsys):
    import cedar.training.cli as train_cli
    from cedar.cli import build_parser

    args = build_parser("train").parse_args(["train", "--out", str(tmp_path / "run"), "--bf16", "--steps", "1"])
    monkeypatch.setattr(train_cli, "bf16_is_native", lambda: False)
    assert args.fn(args) == 2
    assert "bfloat16 instructions" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before anything was built


def test_a_dense_step_reuses_its_attention_as_the_indexer_target(monkeypatch):
    """In a dense step the indexer's target (the main attention over every visible entry) is read
    from the attention's own logits instead of a second pass: the loss and its gradients are the
    same as with the second pass."""
    torch.manual_seed(0)
    model = random_model(cedar_tiny(), seed=3)
    ids = torch.randint(8, model.cfg.vocab_size, (2, 512))
    doc = torch.zeros(2, 512, dtype=torch.long)
    doc[1, 300:] = 1  # two documents in one row: entries across them are invisible

    def loss_and_grads(fwd):
        model.zero_grad()
        logits, aux = fwd.run(ids, doc, Plan(dense_global=True))
        (logits.logsumexp(-1).mean() + aux).backward()
        return aux.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    fwd = DenseForward(model, aux_stride=2)
    aux, grads = loss_and_grads(fwd)
    assert aux > 0
    attention = DenseForward._attention
    monkeypatch.setattr(DenseForward, "_attention", lambda self, *a: (attention(self, *a)[0], None))
    aux2, grads2 = loss_and_grads(DenseForward(model, aux_stride=2))
    assert torch.allclose(aux, aux2, rtol=1e-5, atol=1e-7), (aux, aux2)
    assert grads.keys() == grads2.keys()
    for n in grads:
        assert torch.allclose(grads[n], grads2[n], rtol=1e-4, atol=1e-6), n


def test_exchange_spans_cut_each_copying_request_and_answer_out_of_its_session():
    """Every span runs from a user marker to the end of the assistant message that copies a
    value, within one session; a request answered without a copy, or in another session, is not
    cut; one span per request (to its last copying answer), none overlapping."""
    from cedar.training.trainer import VALUE_START, exchange_spans, pack_pieces

    U, E, A = 1, 2, 3  # user marker, end, assistant marker
    # session 0: system, a request whose answer copies (VALUE_START), a tool turn, a second copy;
    #            then a request answered without a copy
    # session 1: a value copied in an answer whose user message lies in session 0 (never cut)
    toks = [(9, 0), (U, 0), (40, 0), (E, 0), (A, 0), (50, VALUE_START), (51, 1), (E, 1),
            (7, 0), (E, 0), (A, 0), (52, VALUE_START), (E, 1),
            (U, 0), (41, 0), (E, 0), (A, 0), (53, 1), (E, 1),
            (A, 0), (54, VALUE_START), (E, 1)]
    arrays = {"ids": np.array([t for t, _ in toks]), "weight": np.array([w for _, w in toks], np.uint8),
              "doc_start": np.array([0, 19, 22])}
    assert exchange_spans(arrays, U, E, 2048) == [(1, 13)]
    assert exchange_spans(arrays, U, E, 8) == [(1, 8)]  # the longest that fits a row
    assert exchange_spans(arrays, U, E, 6) == []
    rows = pack_pieces([(0, 5), (10, 13), (20, 30)], 16)
    assert sorted(p for r in rows for p in r) == [(0, 5), (10, 13), (20, 30)]
    assert all(sum(b - a + (b - a) % 2 for a, b in r) <= 16 for r in rows)


def test_decision_tokens_are_weighed_by_decision_weight(small_corpus):
    """A DECISION token weighs 1 by default (an assistant token) and ``decision_weight`` when set,
    exactly as a VALUE_START token weighs ``value_start_weight``; the two weights are apart."""
    from cedar.training.trainer import DECISION, VALUE_START, loss_of

    fwd, ids, doc, w = _loss_case(small_corpus[1])
    w[0, 50:60] = DECISION
    as_value = w.clone()
    as_value[0, 50:60] = VALUE_START
    with torch.no_grad():
        even, _ = loss_of(fwd, ids, doc, w, Plan(), TrainConfig(aux_weight=0.0))
        plain, _ = loss_of(fwd, ids, doc, torch.ones_like(w), Plan(), TrainConfig(aux_weight=0.0))
        other, _ = loss_of(fwd, ids, doc, w, Plan(), TrainConfig(aux_weight=0.0, value_start_weight=5.0))
        up, _ = loss_of(fwd, ids, doc, w, Plan(), TrainConfig(aux_weight=0.0, decision_weight=5.0))
        same, _ = loss_of(fwd, ids, doc, as_value, Plan(), TrainConfig(aux_weight=0.0, value_start_weight=5.0))
    assert torch.isclose(even, plain) and torch.isclose(other, even)
    assert not torch.isclose(up, even) and torch.isclose(up, same)

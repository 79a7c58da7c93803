"""The shipped, trained model (models/cedar-agent): its files, and its work through a real server."""

import json

import pytest
import torch
from conftest import start_server, wait_idle_and_check

from cedar.training.corpus.build import HELDOUT, make_tasks, outcome_ok, run_scripted, token_sessions, tokenize_corpus
from cedar.agents.runs import AGENTS
from cedar.backend.chat_template import CHAT_TEMPLATE
from cedar.backend.cli import DEFAULT_MODEL_DIR
from cedar.backend.config import CEDConfig
from cedar.backend.model_io import load_model, save_model
from cedar.backend.tokenizer import MARKUP_TOKENS, ROLE_MARKERS, special_token_ids

MODEL = DEFAULT_MODEL_DIR


def test_the_shipped_checkpoint_round_trips(tmp_path):
    model = load_model(MODEL)
    save_model(model, tmp_path)
    again = load_model(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert CEDConfig.load(tmp_path) == model.cfg
    assert (MODEL / "model.safetensors").stat().st_size < 40 * 2**20


def test_the_tokenizer_fits_the_model_and_the_markup():
    from tokenizers import Tokenizer

    cfg = CEDConfig.load(MODEL)
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg.vocab_size
    conf = json.loads((MODEL / "tokenizer_config.json").read_text())
    assert conf["model_max_length"] == cfg.max_position_embeddings
    assert conf["chat_template"] == CHAT_TEMPLATE  # the served markup (roles, developer, tool calls)
    for t in MARKUP_TOKENS:  # one token each, kept when decoding (the tool-call parser reads them)
        ids = tok.encode(t, add_special_tokens=False).ids
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == t
    texts = [{"kind": t.kind, "text": x} for t in make_tasks(0, "heldout", {k: 2 for k in HELDOUT})
             for x in run_scripted(t)]
    arrays = tokenize_corpus(texts, MODEL)
    nbytes = sum(len(t["text"].encode()) for t in texts)
    assert nbytes / len(arrays["ids"]) >= 3.0


def test_the_model_card_names_its_training_command_and_figures():
    card = (MODEL / "README.md").read_text()
    training = json.loads((MODEL / "training.json").read_text())
    assert training["command"].startswith(("cedar train ", "cedar stage average ")) and training["command"] in card
    if training["command"].startswith("cedar stage average "):  # averaged weights: the stage averaged is trained
        assert training["warm_start"]["command"].startswith("cedar train ") and training["warm_start"]["command"] in card
    assert "held-out" in card and "fidelity" in card.lower()


@pytest.fixture(scope="module")
def shipped_server():
    srv = start_server(MODEL)
    yield srv
    srv.stop()


# NOTE: on held-out bug kinds the shipped model fixes 0/4 bugs (docs/eval.json): a strict xfail,
# which fails the suite the day a retrained model passes it, so the mark is removed then (issue 21).
UNSOLVED = "the shipped model fixes 0/4 held-out bugs (docs/eval.json); issue 21"


def test_the_shipped_model_writes_valid_tool_calls_without_constraints(shipped_server):
    """OpenAI API, `tool_choice: auto` (nothing constrains the text): the model's own calls parse
    with Cedar's tool-call parser and validate against the schemas. (Whether they are the *right*
    calls, and whether agent tasks succeed, is what `cedar evaluate` measures; see the card.)"""
    from cedar.drivers.evaluate import unconstrained_calls

    tasks = make_tasks(0, "heldout", {"function-calling": 4})
    out = unconstrained_calls(shipped_server.url, str(MODEL), tasks)
    assert out["calls"] >= 4 and out["valid"] >= 0.75 * out["calls"], out
    assert sum(out["invalid"].values()) == out["calls"] - out["valid"], out  # every refused call has its reason
    wait_idle_and_check(shipped_server)


def test_the_shipped_model_runs_an_agent_session_through_a_real_server(shipped_server):
    from cedar.frontend.endpoint import CedarEndpoint

    task = make_tasks(0, "heldout", {"react": 1})[0]
    result = AGENTS[task.agent](CedarEndpoint(shipped_server.url), task.inputs)
    steps = result["session"]["steps"]
    assert steps and all(st["tool"] in ("lookup", "calculate", "finish") for st in steps)
    assert all(isinstance(json.loads(st["arguments"]), dict) for st in steps)
    wait_idle_and_check(shipped_server)


@pytest.mark.xfail(strict=True, reason=UNSOLVED)
def test_the_shipped_model_fixes_held_out_bugs_through_a_real_server(shipped_server):
    """The coding agent on held-out bug kinds (a generated module with one bug and its test, in a
    real sandbox), greedy: at least half are solved, i.e. the task's test passes on the files the
    agent left."""
    from cedar.frontend.endpoint import CedarEndpoint

    tasks = make_tasks(0, "heldout", {"coding": 4})
    solved = [outcome_ok(t, AGENTS[t.agent](CedarEndpoint(shipped_server.url), t.inputs)) for t in tasks]
    assert sum(solved) >= 2, solved
    wait_idle_and_check(shipped_server)


def test_fidelity_zero_difference_cases_are_exactly_zero(shipped_server):
    from cedar.drivers.fidelity import fidelity_report

    tasks = make_tasks(0, "heldout", {"recall": 2, "react": 2})
    texts = [{"kind": t.kind, "text": run_scripted(t)[0]} for t in tasks]
    sessions = token_sessions(texts, MODEL)
    cfg = CEDConfig.load(MODEL)
    report = fidelity_report(shipped_server, sessions, special_token_ids(MODEL)[ROLE_MARKERS["assistant"]],
                             cfg.vocab_size, per_bucket=1, log=None)
    small = report["approximations"]["bounded replay"]["H<=W"]
    assert small["cases"] == 1 and small["identical_cases"] == 1 and small["kl_mean"] == 0.0
    snap = report["snapshot_continuation"]
    assert snap["cases"] >= 1 and snap["identical_cases"] == snap["cases"] and snap["kl_mean"] == 0.0
    assert all(r and r > 0 for r in snap["restored"])  # the continuation really restored a snapshot
    far = [c for c in report["cases"] if c["bucket"] == "H>4W"]
    assert far and far[0]["replayed"]["bounded"] == 128 and far[0]["replayed"]["exact"] == far[0]["H"]
    wait_idle_and_check(shipped_server)

"""Scale-out through SGLang's own router (``cedar serve --replicas 2``'s machinery on loopback,
two small replicas): a session's turns keep their prefix hits through the cache-aware router,
and requests are still served after one replica is stopped."""

import pytest

from cedar.backend.serving.launch import ServeConfig
from cedar.backend.serving.process import ServerClient, free_port
from cedar.backend.serving.replicas import Replicas, RouterConfig

from server_helpers import generate, prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    base = ServeConfig(model=str(tiny_model_dir), extra=("--sleep-on-idle", "--max-total-tokens", "16384",
                                                         "--context-length", "4096"))
    # NOTE: health checks five minutes apart: a stopped replica is still "healthy" to the router
    # throughout the test, so only the retries and the circuit breaker can route around it
    router = RouterConfig(port=free_port(3), health_interval_s=300)
    r = Replicas(base, 2, router, log_dir=tmp_path_factory.mktemp("replicas")).start()
    yield r
    r.stop()


def _router(replicas) -> ServerClient:
    return ServerClient(replicas.url)


def test_sessions_keep_their_hits_through_the_cache_aware_router(replicas):
    client = _router(replicas)
    sessions = [prompt(300, 900 + i) for i in range(5)]  # odd: round robin would move every session
    kept = [0] * len(sessions)  # what the last turn left in its replica's tree
    for turn in range(3):
        for i, ctx in enumerate(sessions):
            ids, _, meta = generate(client, ctx, n=4)
            assert meta["cached_tokens"] == kept[i], (turn, i, meta)  # 0 had it gone to the other replica
            kept[i] = (len(ctx) + len(ids) - 1) // 2 * 2  # prompt and fed outputs, page-aligned
            sessions[i] = ctx + ids + prompt(40, 1000 + 10 * turn + i)
    # both replicas took sessions (the router spread them), and the hits above came from the tree
    assert all(n > 0 for n in replicas_requests(replicas)), replicas_requests(replicas)


def replicas_requests(replicas) -> list[int]:
    return [s.cedar_state()["forward_ms"]["extend"]["forwards"] for s in replicas.servers]


def test_a_stopped_replica_leaves_the_router_serving(replicas):
    client = _router(replicas)
    session = prompt(300, 1200)
    before = replicas_requests(replicas)
    ids, _, _ = generate(client, session, n=3)
    home = next(i for i, (a, b) in enumerate(zip(before, replicas_requests(replicas))) if b > a)
    replicas.servers[home].stop()
    # the session's next turn matches only the stopped replica's
    # tree, so the cache-aware router picks it; the circuit breaker must move the retry elsewhere
    ids, _, _ = generate(client, session + ids + prompt(40, 1201), n=3)
    assert len(ids) == 3
    for i in range(6):  # new sessions: the router must not send them to the stopped replica
        ids, _, _ = generate(client, prompt(120, 1100 + i), n=3)
        assert len(ids) == 3
    assert replicas.router.poll() is None

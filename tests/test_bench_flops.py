"""The FLOP model behind `cedar bench prefill`'s analytic bound."""

from cedar.drivers.bench.flops import flop_estimate, layer_flops, narrowing_speedup_bound, prefill_flops
from cedar.backend.geometries import cedar_tiny, v41_flash


def test_no_speedup_when_the_prompt_fits_the_window():
    cfg = cedar_tiny()
    for P in (1, 64, cfg.sliding_window):
        assert narrowing_speedup_bound(cfg, P) == 1.0


def test_bound_grows_with_the_prompt_and_dominates_the_flop_estimate():
    cfg = cedar_tiny()
    bounds = [narrowing_speedup_bound(cfg, P) for P in (256, 512, 2048, 8192)]
    assert bounds == sorted(bounds) and 1.0 < bounds[0]
    for P in (256, 512, 2048, 8192):
        assert flop_estimate(cfg, P) <= narrowing_speedup_bound(cfg, P)
    # half the layers skipped bounds the linear part near 2; the decoder's two indexers (vs the
    # encoder's one at ratio 2) bound the quadratic part near 1 + 4 = 5 for long prompts
    assert 1.9 < bounds[-1] < 5.0
    assert prefill_flops(cfg, 2048, narrow=True) < prefill_flops(cfg, 2048, narrow=False)


def test_indexer_term_is_quadratic():
    cfg = v41_flash()
    a, b = layer_flops(cfg, 20, 0, 1000), layer_flops(cfg, 20, 0, 2000)
    assert b > 2.0 * a  # more than linear in the rows

"""Tools that drive a running server: benchmarks (bench/), the soak (soak/), the evaluation and the
fidelity report. They sit above every other layer and nothing imports them."""

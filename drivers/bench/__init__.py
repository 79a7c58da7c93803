"""Benchmarks that drive Cedar's real SGLang server over HTTP (``cedar bench ...``)."""

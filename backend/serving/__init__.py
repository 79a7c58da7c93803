"""Cedar inside SGLang 0.5.23: the served model, its pools, and the extension-point glue."""

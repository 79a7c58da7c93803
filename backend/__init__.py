"""Cedar: CED models with FP4/FP8 caches and bounded replay, served by SGLang."""

"""SGLang external model package (``SGLANG_EXTERNAL_MODEL_PACKAGE=cedar.backend.sglang_models``):
SGLang imports every module here and registers each module-level ``EntryClass``."""

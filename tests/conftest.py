"""Shared pytest set-up.

NOTE: Triton reads TRITON_INTERPRET when a ``@triton.jit`` kernel is defined, so on a machine
without CUDA it must be set here, before any test module imports a ``*_triton`` kernel module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""Build and load Cedar's C++ CPU kernels (``csrc/cedar_cpu.cpp``) as ``torch.ops.cedar_cpu``.

Built once by the setup script (``python -m cedar.kernels.cpu_ext``: about 30 s on 2 cores) into
torch's extension cache; a process that finds it built loads it in well under a second. Where it
cannot be built (no compiler), :func:`available` is False and the fast backend runs its batched
torch path instead (slower decode, same results): the choice is made once per process.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cedar_cpu.cpp"
NAME = "cedar_cpu"


def build(verbose: bool = False) -> None:
    """Compile (if the source changed) and load the library; raises on failure."""
    # NOTE: importing cpp_extension probes for CUDA and, on a host with nvcc but no GPU, warns "No
    # CUDA runtime is found" in every server process; this build is CPU-only, so that one is muted
    probe_log = logging.getLogger("torch.utils.cpp_extension")
    level = probe_log.level
    probe_log.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load
    finally:
        probe_log.setLevel(level)

    # NOTE: cpp_extension runs `ninja` from PATH; the venv's own ninja sits beside its python,
    # which a process started by path (not an activated venv) does not have on PATH
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")

    # NOTE: -fopenmp: ATen's at::parallel_for is OpenMP pragmas inlined into the caller; without
    # it every kernel ran on one thread (libgomp.so.1 resolves to the copy torch already loaded)
    load(NAME, [str(SOURCE)], extra_cflags=cflags(), extra_ldflags=["-fopenmp"], is_python_module=False,
         verbose=verbose)


def cflags() -> list[str]:
    """-O3 without FMA contraction; AVX2 and AVX-512F where this machine has them (the library is
    built on the machine that runs it, so no other machine ever loads it)."""
    flags = ["-O3", "-ffp-contract=off", "-fopenmp"]  # NOTE: no FMA contraction: results independent of vectorization
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu = ""
    if " avx2" in cpu:
        flags += ["-mavx2"]
    if " avx512f" in cpu:  # NOTE: the indexer's 16-entry key blocks (the same sums as 8)
        flags += ["-mavx512f"]
    return flags


@functools.cache
def available() -> bool:
    """Load the library once per process; False (with a warning) where it cannot be built."""
    if os.environ.get("CEDAR_NO_CPU_EXT"):
        return False
    try:
        build()
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("cedar C++ CPU kernels unavailable (%s); decode runs the batched torch path", e)
        return False
    return True


if __name__ == "__main__":
    build(verbose=True)
    print("cedar_cpu kernels built and loaded")

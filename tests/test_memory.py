"""Byte accounting (SPEC section 2) and the `cedar memory` command."""

import json
import subprocess
import sys

from cedar.backend.geometries import cedar_tiny, v41_flash
from cedar.backend.memory import memory_report


def test_v41_flash_figures():
    r = memory_report(v41_flash())
    assert (r.global_row_bytes, r.index_row_bytes, r.swa_row_bytes) == (288, 68, 528)
    assert r.global_bytes_per_token == 890
    assert r.swa_bytes_per_request == 2703360 == 40 * 128 * 528
    assert r.fp16_all_layers_bytes_per_token == 40 * 512 * 2
    assert r.compressor_tail_bytes_per_request == 3 * 1 * 512 * 4 * 2


def test_cedar_tiny_figures():
    r = memory_report(cedar_tiny())
    # latent 64: global row 32 + 4 B, index row 16 + 1 B; sources: layer 1 (r=2), layer 4 (r=1)
    assert (r.global_row_bytes, r.index_row_bytes) == (36, 17)
    assert r.global_bytes_per_token == (36 + 17) / 2 + (36 + 17)
    assert r.swa_bytes_per_request == 8 * 128 * (64 + 2)


def test_cli_memory_json():
    out = subprocess.run([sys.executable, "-m", "cedar.cli", "memory", "--geometry", "v41-flash", "--json"],
                         capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    assert d["global_bytes_per_token"] == 890 and d["swa_bytes_per_request"] == 2703360
    assert "fp16_all_layers_bytes_per_token" in d


def test_cli_unknown_geometry_is_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "cedar.cli", "memory", "--geometry", "nope"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "unknown geometry 'nope'" in p.stderr

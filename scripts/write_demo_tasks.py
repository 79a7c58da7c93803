"""Write agents/tasks/demo_heldout.json: the held-out tasks `make demo` runs
(``cedar.training.corpus.build.demo_tasks``; tests/test_corpus.py checks the file is current).

    .venv/bin/python scripts/write_demo_tasks.py
"""

from __future__ import annotations

import json
from pathlib import Path

from cedar.training.corpus.build import demo_tasks

OUT = Path(__file__).resolve().parents[1] / "agents" / "tasks" / "demo_heldout.json"

if __name__ == "__main__":
    OUT.write_text(json.dumps([t.to_json() for t in demo_tasks()], indent=1) + "\n")
    print(f"wrote {OUT}")

"""kvslim.hf with transformers itself (skipped where transformers is not installed: Debian 12 has no
python3-transformers; python/gpu_check.sh runs the full check on the GPU machine)."""
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 1):
    pytest.skip("fp16 matmul on the CPU needs torch >= 2.1", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
from gpu_hf_check import ROOT, check_model  # noqa: E402


def test_every_method_generates_and_full_matches_dynamic_cache():
    d = ROOT / "tests/golden/models/llama_gqa"
    import json
    ids = json.loads((d / "golden.json").read_text())["input_ids"]
    records, ok = check_model("golden/llama_gqa", d, ids, "cpu", torch.float16, new_tokens=12)
    failed = [(r["variant"], r.get("error")) for r in records if not r["pass"]]
    assert ok, failed
    assert all(r["resident_bytes"] > 0 for r in records)

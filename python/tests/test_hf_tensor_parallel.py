"""kvslim.hf under transformers' tensor parallelism (issue 29, item 1): a Llama loaded with
from_pretrained(..., tp_plan="auto") on 2 CPU ranks (gloo) generates through KVSlimCache, each
rank's caches holding its half of the KV heads and agreeing through kvslim.distributed; compared
with the same model in one process (hf_tp_worker.py: the records and the comparison).

Needs transformers and torch >= 2.5 (transformers' tensor parallelism): skipped on Debian 12 (no
python3-transformers), run on the GPU machine with the GPU hidden from the ranks."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 5):
    pytest.skip("transformers' tensor parallelism needs torch >= 2.5", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))
import hf_tp_worker  # noqa: E402

WORKER = Path(__file__).parent / "hf_tp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_cpu_ranks_generate_what_one_process_generates(tmp_path):
    model_dir, out_dir = tmp_path / "model", tmp_path / "out"
    hf_tp_worker.save_model(model_dir)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, str(WORKER), str(model_dir), str(out_dir)], env=env, check=True, timeout=600)
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, str(WORKER), str(model_dir), str(out_dir)],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=port))
             for r in range(2)]
    codes = [p.wait(timeout=600) for p in ranks]
    assert codes == [0, 0], f"ranks exited with {codes}"
    lines, failures = hf_tp_worker.compare(out_dir)
    print("\n".join(lines))
    assert not failures, failures
    # Each rank held its own half of the heads.
    import pickle
    slices = [pickle.loads((out_dir / f"rank{r}.pkl").read_bytes())["methods"]["full"]["head_slice"] for r in range(2)]
    assert slices == [(0, 2), (2, 4)], slices

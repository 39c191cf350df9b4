"""bench/cuda/ncu_stalls.py (the device profile's reader) on a small CSV of ncu's source-page form:
samples and executed instructions summed per opcode, predicates and modifiers stripped, the
not-issued stall columns kept apart, and a file without SASS lines refused by name."""
import importlib.util
import lzma
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "bench", "cuda", "ncu_stalls.py")


def load_tool():
    spec = importlib.util.spec_from_file_location("ncu_stalls", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CSV = """==PROF== Connected to process 1
"Kernel Name","void attend_codes_half_kernel<(int)2, (int)2, (int)128>(QueryArgs)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","Instructions Executed","stall_wait","stall_math","stall_wait (Not Issued)"
"0x7f0000000000","      LOP3.LUT R1, R2, 0x3, RZ, 0xc0, !PT","10","6","100","7","3","5"
"0x7f0000000010","@!P0  LOP3.LUT R3, R2, 0xc, RZ, 0xc0, !PT","4","1","50","4","0","1"
"0x7f0000000020","      IMMA.16832.S8.S8 R4, R8, R12, R4","20","15","16","5","15","4"
"0x7f0000000030","      EXIT","0","0","1","0","0","0"
"""


def test_per_opcode_sums(tmp_path):
    tool = load_tool()
    path = tmp_path / "k.csv.xz"
    with lzma.open(path, "wt") as f:
        f.write(CSV)
    (kernel,) = tool.parse(str(path))
    assert "attend_codes_half_kernel" in kernel.name
    samples, executed, reasons = tool.by_opcode(kernel)
    assert samples == {"LOP3": 14, "IMMA": 20, "EXIT": 0}
    assert executed == {"LOP3": 150, "IMMA": 16, "EXIT": 1}
    # the not-issued columns are a subset of the samples, not more reasons
    assert reasons["LOP3"] == {"wait": 11, "math": 3}
    assert reasons["IMMA"] == {"wait": 5, "math": 15}


def test_two_files_side_by_side(tmp_path):
    a, b = tmp_path / "kivi2.csv", tmp_path / "k4v2.csv"
    a.write_text(CSV)
    b.write_text(CSV.replace('"20","15","16"', '"40","30","32"'))
    out = subprocess.run([sys.executable, TOOL, str(a), str(b), "--per", "kivi2=2", "--per", "k4v2=2"],
                         capture_output=True, text=True, check=True).stdout
    imma = next(line for line in out.splitlines() if line.startswith("IMMA"))
    # 1000 * 20 / 2 against 1000 * 40 / 2 samples, 8 against 16 instructions a unit
    assert imma.split()[1:4] == ["10000.0", "20000.0", "-10000.0"]
    assert imma.split()[4:6] == ["8.00", "16.00"]


@pytest.mark.parametrize("text", ["", "not,a,profile\n", '"Address","Source"\n'])
def test_a_file_without_lines_is_refused(tmp_path, text):
    path = tmp_path / "empty.csv"
    path.write_text(text)
    run = subprocess.run([sys.executable, TOOL, str(path)], capture_output=True, text=True)
    assert run.returncode != 0
    assert "no SASS lines" in run.stderr


def test_per_names_a_file(tmp_path):
    a = tmp_path / "a.csv"
    a.write_text(CSV)
    run = subprocess.run([sys.executable, TOOL, str(a), str(a), "--per", "b=3"], capture_output=True, text=True)
    assert run.returncode == 2
    assert "--per b=3" in run.stderr

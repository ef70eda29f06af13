"""scripts/kernel_resources.py reads ptxas's report and the SASS of the CUDA kernels: its
parsers on canned text (no toolkit needed), and one real unit where nvcc and cuobjdump exist."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kernel_resources.py"
sys.path.insert(0, str(ROOT / "scripts"))

import kernel_resources  # noqa: E402

PTXAS = """\
ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90'
ptxas info    : Function properties for _Z1kPf
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 8 bytes cumulative stack size, 36 bytes smem
ptxas info    : Function properties for _Z1gv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers
"""

# A loop (0x20-0x80) holding a 16-byte load, a spill reload, an inline 32-bit division and a
# call to a routine that divides in 64 bits; a byte store and a generic load outside it.
SASS = """\
        Function : _Z1kPf
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LD.E.64 R2, desc[UR4][R4.64] ;
        /*0020*/                   LDG.E.128.CONSTANT R8, desc[UR4][R2.64] ;
        /*0030*/                   LDL.LU R6, [R1] ;
        /*0040*/                   I2F.U32.RP R0, R7 ;
        /*0050*/                   CALL.REL.NOINC 0xc0 ;
        /*0060*/                   STG.E.64 desc[UR4][R2.64], R8 ;
        /*0070*/                   ISETP.NE.AND P0, PT, R6, RZ, PT ;
        /*0080*/               @P0 BRA 0x20 ;
        /*0090*/                   STG.E.U8 desc[UR4][R2.64], R8 ;
        /*00a0*/                   EXIT ;
        /*00b0*/                   BRA 0xb0 ;
        /*00c0*/                   I2F.U64.RP R12, UR4 ;
        /*00d0*/                   DADD R12, R12, R14 ;
        /*00e0*/                   RET.REL.NODEC R4 0x0 ;
"""


def test_help_runs_without_a_toolkit():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--files" in out.stdout


def test_ptxas_report_is_read_per_entry():
    props = kernel_resources.parse_ptxas(PTXAS)
    assert props["_Z1kPf"] == {"regs": 64, "stack": 8, "spill_stores": 4, "spill_loads": 12,
                               "smem": 36}
    assert props["_Z1gv"]["regs"] == 30 and props["_Z1gv"]["smem"] == 0


def test_sass_counts_widths_local_traffic_and_divisions_in_loops():
    instrs = kernel_resources.split_sass(SASS)["_Z1kPf"]
    r = kernel_resources.analyze_sass(instrs)
    assert r["ldg"] == {"128": 1}
    assert r["stg"] == {"64": 1, "8": 1}
    assert r["generic_ldst"] == 1
    assert (r["ldl"], r["stl"], r["local_in_loop"]) == (1, 0, 1)
    # Two division sequences (one inline, one in the routine); both run inside the loop.
    assert (r["intdiv"], r["intdiv_in_loop"]) == (2, 2)
    assert r["fp64"] == 1


@pytest.mark.parametrize("regs,smem,threads,blocks", [
    (64, 0, 512, 2),     # the AdamW kernel: 2 blocks of 512 fill 2048 threads
    (84, 0, 256, 2),     # 84 registers round to 88 a thread: 23 warps' worth, 2 blocks of 8
    (30, 64, 256, 8),    # thread-limited
    (32, 100 * 1024, 256, 2),  # shared-memory-limited
])
def test_occupancy_on_an_h100_sm(regs, smem, threads, blocks):
    got, occupancy = kernel_resources.occupancy(regs, smem, threads)
    assert got == blocks
    assert occupancy == blocks * threads / 2048


@pytest.fixture(scope="module")
def fingerprint_row(tmp_path_factory):
    if not (kernel_resources.find_tool("nvcc") and kernel_resources.find_tool("cuobjdump")):
        pytest.skip("needs nvcc and cuobjdump")
    keep = tmp_path_factory.mktemp("sass")
    out = subprocess.run([sys.executable, str(SCRIPT), "--files", "fingerprint", "--json",
                          "--keep", str(keep)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["kernel"] for r in rows] == ["fingerprint_kernel"]
    assert (keep / "fingerprint.sass").exists()
    return rows[0]


def test_real_unit_gives_one_row_per_kernel(fingerprint_row):
    row = fingerprint_row
    assert row["threads"] == 256 and row["regs"] > 0 and row["blocks_per_sm"] >= 1
    assert row["spill_stores"] == 0 and row["ldl"] == 0


def test_fingerprint_keys_stay_in_registers(fingerprint_row):
    # Each lane has its own stripe keys: read from the kernel's parameters at a lane-dependent
    # offset inside the loop, a warp's 32 keys take 32 turns at the constant cache for every
    # 4 KiB. Only the per-range initial value may be read there.
    assert fingerprint_row["indexed_const_in_loop"] <= 1

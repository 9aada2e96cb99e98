"""Register count and load order of the one-token decode kernels as this machine's Triton compiles them for sm_90
(no GPU needed: Triton's compiler and ptxas), with the divisibility a real launch specializes on (pointers and
strides by 16). The order shows whether ptxas issues a program's weight loads before its FMAs ("L24 F360": 24
loads, then 360 FMAs) or interleaves them, which serialises the loads' round trips.

    python3 benchmarks/sass_order.py        (run without TRITON_INTERPRET)
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from moeloop.rollout import moe_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_triton_sm90_compile import compile_sm90  # noqa: E402 (the compile test's helper)

D, F, E, K = 1536, 512, 64, 4  # reference Qwen3-MoE


def registers(ptx: str) -> str:
    """ptxas -v's register and spill line for the PTX (Triton's ptxas, or its newer one for a newer PTX)."""
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for name in ("ptxas", "ptxas-blackwell"):
            proc = subprocess.run([str(bin_dir / name), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.o")],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                regs = re.search(r"Used (\d+) registers", proc.stderr)
                spills = re.search(r"(\d+) bytes spill stores", proc.stderr)
                return f"{regs.group(1)} registers, {spills.group(1) if spills else 0} B spilled"
    return "ptxas failed"


def load_order(cubin: bytes) -> str:
    """Runs of global loads (L) and float FMAs/multiplies/adds (F) in the SASS, in program order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        sass = subprocess.run([str(cuobjdump if cuobjdump.exists() else "cuobjdump"), "-sass", str(path)],
                              capture_output=True, text=True, check=True).stdout
    kinds = ["L" if "LDG" in line else "F" for line in sass.splitlines()
             if re.search(r"\b(LDG\S*|FFMA|FMUL|HFMA2|FADD)\b", line)]
    runs = []
    for kind in kinds:
        if runs and runs[-1][0] == kind:
            runs[-1][1] += 1
        else:
            runs.append([kind, 1])
    return " ".join(f"{k}{n}" for k, n in runs[:16]) + (" ..." if len(runs) > 16 else "")


def main() -> None:
    print(f"triton {triton.__version__}")
    gate_up = dict(x_ptr="*bf16", w_ptr="*bf16", ids_ptr="*bf16", h_ptr="*bf16", s_we="i64", s_wf="i64")
    for rows, warps in ((8, 4), (8, 8), (4, 4)):
        c = compile_sm90(moe_kernel._gate_up_silu, gate_up,
                         dict(D=D, F=F, K=K, BLOCK_F=rows, BLOCK_D=2048, LIBDEVICE=True, PDL=True, ROUTED=True, E=E,
                              E_PAD=E), num_warps=warps, divisible=True)
        print(f"_gate_up_silu rows={rows} warps={warps}: {registers(c.asm['ptx'])} | {load_order(c.asm['cubin'])}")
    down = dict(h_ptr="*bf16", w_ptr="*bf16", ids_ptr="*bf16", y_ptr="*bf16", s_we="i64", s_wd="i64")
    c = compile_sm90(moe_kernel._down_combine, down, dict(wts_ptr=None, D=D, F=F, K=K, K_PAD=K, BLOCK_D=4,
                                                         BLOCK_F=512, EARLY=True, PDL=True, ROUTED=True, E=E,
                                                         E_PAD=E, SCALE=1.0, NORM=True), divisible=True)
    print(f"_down_combine rows=4 warps=4: {registers(c.asm['ptx'])} | {load_order(c.asm['cubin'])}")


if __name__ == "__main__":
    main()

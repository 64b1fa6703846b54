"""The kernels each backend registers, read from the sources that register them (not from a
list kept beside the tests), so a kernel added to a backend without a test that dispatches
it fails `test_kernel_coverage.py` / `test_metal_emulator_coverage.py` (issue 27, "entry
points never dispatched"):

- CPU: the names of the `KERNELS` tables in `rust/src/backend/cpu/*.rs` (the kernels
  `backend::cpu::kernel` looks a dispatch's name up in);
- CUDA: the names of the `KERNELS` tables in `rust/src/backend/cuda/*.rs` (what a dispatch
  may name), and the entry points of `shaders/*.cu` (with the parts under
  `shaders/flash_attn_prefill/`) in each form a device runs: the Hopper form (sm_90a) and
  the portable one (any other architecture, `MLX_NATIVE_CUDA_ARCH=sm_90` on a Hopper GPU);
- Metal: the `kernel void` entry points of `shaders/*.metal`, with those an instantiation
  macro makes (what the emulator registers and a Metal device's library holds).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]
SHADERS = ROOT / "shaders"


def _read(path: Path) -> str:
    # Line comments out: a name in a comment registers nothing.
    return re.sub(r"//[^\n]*", "", path.read_text())


def _tables(folder: Path) -> List[str]:
    """The `KERNELS` table bodies of the Rust files in `folder`."""
    bodies = []
    for f in sorted(folder.glob("*.rs")):
        text = _read(f)
        for m in re.finditer(r"pub const KERNELS\s*:[^=]*=\s*", text):
            # The table runs to the `;` that closes it at bracket depth 0.
            depth, i = 0, m.end()
            while True:
                ch = text[i]
                if ch in "[({":
                    depth += 1
                elif ch in "])}":
                    depth -= 1
                elif ch == ";" and depth == 0:
                    break
                i += 1
            bodies.append(text[m.end() : i])
    return bodies


def cpu_kernels() -> Set[str]:
    """Names of the CPU backend's kernels: the `("name", function)` rows of its tables."""
    names = set()
    for body in _tables(ROOT / "rust" / "src" / "backend" / "cpu"):
        names |= set(re.findall(r'\(\s*"(\w+)"\s*,', body))
    return names


def cuda_kernels() -> Set[str]:
    """Names of the CUDA backend's kernels: `name: "..."` fields and the first argument of
    each `attention_kernel!(...)` and `quant_kernel!(...)` row of its tables."""
    names = set()
    for body in _tables(ROOT / "rust" / "src" / "backend" / "cuda"):
        names |= set(re.findall(r'\bname:\s*"(\w+)"', body))
        names |= set(re.findall(r'attention_kernel!\(\s*"(\w+)"', body))
        names |= set(re.findall(r'quant_kernel!\(\s*"(\w+)"', body))
    return names


def op_registered_kernels() -> Set[str]:
    """The prefill op's `REGISTERED_KERNELS` (rust/src/ops/flash_attn_prefill.rs), with the
    constants it names resolved."""
    text = _read(ROOT / "rust" / "src" / "ops" / "flash_attn_prefill.rs")
    consts = dict(re.findall(r'pub const (\w+): &str = "(\w+)";', text))
    body = re.search(r"pub const REGISTERED_KERNELS: &\[&str\] = &\[(.*?)\];", text, re.S).group(1)
    items = [x.strip() for x in body.split(",") if x.strip()]
    return {x.strip('"') if x.startswith('"') else consts[x] for x in items}


#: The CUDA entry point macros of shaders/flash_attn_prefill/entry.cuh: the entry points
#: each one defines in the Hopper form (sm_90a) and in the portable one.
_CUDA_MACROS = {
    # The Hopper form where the compiler targets sm_90a, else the portable one with `_xf`.
    "MLXN_ENTRY": (("",), ("", "_xf")),
    # The portable form everywhere: the plain entry and the one with the score transforms.
    "MLXN_PORTABLE_ENTRY": (("", "_xf"), ("", "_xf")),
    # The CTA-pair forms: sm_90a only (inside `#ifdef MLXN_HOPPER`).
    "MLXN_PAIR_ENTRY": (("",), ()),
}


def cuda_entry_points(hopper: bool) -> Dict[str, Set[str]]:
    """The entry points each CUDA source file compiles to (file name -> names) in the Hopper
    form (`hopper`) or the portable one: the instantiation macros of the `.cu` files, and the
    `extern "C"` kernels written out (the classifiers, and the split-KV merge every attention
    file includes)."""
    parts = SHADERS / "flash_attn_prefill"
    merge = set(re.findall(r'extern "C" __global__ void[^(]*\([^)]*\)\s*(\w+)\s*\(', _read(parts / "split_merge.cuh")))
    assert merge == {"flash_attn_prefill_split_merge"}, merge
    out = {}
    for f in sorted(SHADERS.glob("*.cu")):
        text = _read(f)
        names = set(re.findall(r'extern "C" __global__ void[^(]*\([^)]*\)\s*(\w+)\s*\(', text))
        for macro, (h_sfx, p_sfx) in _CUDA_MACROS.items():
            for name in re.findall(rf"^{macro}\((\w+)\s*,", text, re.M):
                names |= {name + s for s in (h_sfx if hopper else p_sfx)}
        if '#include "flash_attn_prefill/entry.cuh"' in text:
            names |= merge
        out[f.name] = names
    return out


def cuda_entries(hopper: bool) -> Set[str]:
    """Every CUDA entry point of one form (:func:`cuda_entry_points`, all files)."""
    return set().union(*cuda_entry_points(hopper).values())


def metal_entries() -> Set[str]:
    """The entry points of the Metal sources, as the emulator finds and registers them."""
    from metal_emu import entry_points

    names = set()
    for f in sorted(SHADERS.glob("*.metal")):
        names |= set(entry_points(_read(f)))
    return names

"""Build and run the CPU emulator of the Metal kernels in ``shaders/``.

The ``.metal`` files are compiled unchanged by the system C++ compiler after one textual
step (:func:`translate`): each parameter attribute ``[[buffer(N)]]``, ``[[threadgroup(N)]]``,
``[[threadgroup_position_in_grid]]``, ... becomes a default argument that binds the parameter
from the running thread, and each ``kernel`` entry point is registered by name. The headers
under ``include/`` stand in for ``<metal_stdlib>``, ``<metal_tensor>`` and
``<MetalPerformancePrimitives/MetalPerformancePrimitives.h>``. ``docs/metal.md`` says what is
modelled and what is not."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
#: Where the kernel sources are read from: ``shaders/``, or the folder ``MLXN_METAL_SHADER_DIR``
#: names (scripts/mutate_kernels.py points it at a mutated copy; a file it lacks is read from
#: ``shaders/``).
SHADERS = REPO / "shaders"
_OVERRIDE = os.environ.get("MLXN_METAL_SHADER_DIR")

#: The kernel sources the emulator is built from (file name -> path).
SHADER_FILES = {
    name: (Path(_OVERRIDE) / name if _OVERRIDE and (Path(_OVERRIDE) / name).is_file() else SHADERS / name)
    for name in ("flash_attn_prefill_tensor.metal", "flash_attn_prefill_blk.metal")
}

#: Parameter attributes the emulator binds (anything else in ``[[...]]`` is an error).
BINDING_ATTRIBUTES = {
    "buffer",
    "threadgroup",
    "threadgroup_position_in_grid",
    "threadgroups_per_grid",
    "thread_position_in_threadgroup",
    "threads_per_threadgroup",
    "thread_position_in_grid",
    "thread_index_in_threadgroup",
    "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup",
    "threads_per_simdgroup",
    "simdgroups_per_threadgroup",
}

# -ftrivial-auto-var-init=pattern: every thread-private variable a kernel does not
# initialise starts as 0xfe bytes (a float of -1.69e38, an int of -16843010), not as
# whatever an earlier fiber left on the stack, so a kernel that relies on uninitialised
# state computes something wrong (docs/metal.md).
CXX_FLAGS = [
    "-std=c++20",
    "-O2",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-Wno-unused-variable",
    "-ftrivial-auto-var-init=pattern",
]

_ATTRIBUTE = re.compile(r"\[\[\s*(\w+)\s*(?:\(([^()]*)\))?\s*\]\]")
_ENTRY = re.compile(r"\bkernel\s+void\s+(\w+)\s*\(")
# A macro that instantiates one entry point per use (the shaders' INSTANTIATE_PREFILL): its
# body declares `kernel void PREFIX##PARAM(`, PARAM the macro's first parameter.
_ENTRY_MACRO = re.compile(
    r"^[ \t]*#[ \t]*define[ \t]+(\w+)\([ \t]*(\w+)[^)]*\)(?:[^\n]*\\\n)*?[^\n]*?"
    r"\bkernel\s+void\s+(\w+)\s*##\s*\2\s*\(",
    re.M,
)


class EmulatorError(RuntimeError):
    """The emulator could not be built, or a kernel broke the execution model."""


def translate(source: str, filename: str) -> str:
    """The C++ translation unit of one ``.metal`` source: attributes become binding default
    arguments, entry points are registered; line numbers are kept (``#line``)."""

    def attribute(m: re.Match) -> str:
        name, args = m.group(1), m.group(2) or ""
        if name not in BINDING_ATTRIBUTES:
            raise EmulatorError(f"{filename}: the emulator does not support the attribute [[{m.group(0)[2:-2]}]]")
        return f" = ::metal_emu::attr::bind_{name}({args})"

    body = _ATTRIBUTE.sub(attribute, source)
    entries = entry_points(source)
    if not entries:
        raise EmulatorError(f"{filename}: no kernel entry point")
    registrars = "\n".join(
        f'static ::metal_emu::entry_registrar metal_emu_entry_{n}("{n}", [] {{ {n}(); }});' for n in entries
    )
    return f'#line 1 "{filename}"\n{body}\n#line 1 "<metal_emu entry points>"\n{registrars}\n'


def entry_points(source: str) -> List[str]:
    """The names of the ``kernel`` entry points of one ``.metal`` source, in order: those
    declared as ``kernel void NAME(``, then those an instantiation macro makes (``#define
    M(SUFFIX, ...)`` declaring ``kernel void PREFIX##SUFFIX(``; each line ``M(x, ...)``
    makes ``PREFIX`` + ``x``)."""
    names = _ENTRY.findall(source)
    for macro, _, prefix in _ENTRY_MACRO.findall(source):
        uses = re.findall(rf"^[ \t]*{macro}[ \t]*\([ \t]*(\w+)[ \t]*,", source, re.M)
        names += [prefix + suffix for suffix in uses]
    return names


def _object_name(stem: str, text: str) -> str:
    """Object files are named by a hash of what went into them, so a build directory can be
    reused for builds that differ in one source only."""
    h = hashlib.sha256(text.encode())
    h.update(" ".join(CXX_FLAGS).encode())
    for header in sorted(HERE.rglob("*.h")) + sorted((HERE / "include").rglob("*")):
        if header.is_file():
            h.update(header.read_bytes())
    return f"{stem}-{h.hexdigest()[:16]}.o"


def _compile(cxx: str, src: Path, obj: Path) -> subprocess.Popen:
    cmd = [cxx, *CXX_FLAGS, "-I", str(HERE), "-I", str(HERE / "include"), "-c", str(src), "-o", str(obj)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def compiler() -> Optional[str]:
    """The C++ compiler to use: ``$CXX``, else ``g++``, else ``c++``; None if there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def build(out_dir: Path, sources: Optional[Mapping[str, str]] = None) -> Path:
    """Compile the emulator with the given kernel sources (file name -> text; by default the
    files in ``shaders/``) into ``out_dir``; returns the executable."""
    cxx = compiler()
    if cxx is None:
        raise EmulatorError("no C++ compiler found (set CXX)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if sources is None:
        sources = {name: path.read_text() for name, path in SHADER_FILES.items()}
    runtime = HERE / "runtime.cpp"
    objects = [(runtime, out_dir / _object_name("runtime", runtime.read_text()))]
    for name, text in sources.items():
        cpp_text = translate(text, f"shaders/{name}")
        stem = Path(name).stem
        cpp = out_dir / f"{stem}-{hashlib.sha256(cpp_text.encode()).hexdigest()[:16]}.cpp"
        cpp.write_text(cpp_text)
        objects.append((cpp, out_dir / _object_name(stem, cpp_text)))
    todo = [(src, obj) for src, obj in objects if not obj.exists()]
    # A few compilations at a time (the CI machine has two cores).
    width = max(1, min(len(todo), os.cpu_count() or 1))
    errors = []
    for i in range(0, len(todo), width):
        procs = [(src, _compile(cxx, src, obj)) for src, obj in todo[i : i + width]]
        for src, proc in procs:
            out, _ = proc.communicate()
            if proc.returncode != 0:
                errors.append(f"{src.name}:\n{out}")
    if errors:
        raise EmulatorError("the emulator did not compile:\n" + "\n".join(errors))
    key = hashlib.sha256(" ".join(obj.name for _, obj in objects).encode()).hexdigest()[:16]
    exe = out_dir / f"metal_emu-{key}"
    if exe.exists():
        return exe
    link = subprocess.run(
        [cxx, "-pthread", *[str(obj) for _, obj in objects], "-o", str(exe)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if link.returncode != 0:
        raise EmulatorError(f"the emulator did not link:\n{link.stdout}")
    return exe


class Emulator:
    """A built emulator: runs one dispatch per call."""

    def __init__(self, exe: Path):
        self.exe = Path(exe)

    def dispatch(
        self,
        kernel: str,
        grid,
        threads,
        *,
        buffers: Mapping[int, np.ndarray],
        constants: Mapping[int, bytes] = {},
        threadgroup_memory: Mapping[int, int] = {},
        schedule: str = "forward",
        layout_seed: int = 0,
        jobs: Optional[int] = None,
    ) -> Dict[int, np.ndarray]:
        """Run ``kernel`` over ``grid`` threadgroups of ``threads`` threads, with each array of
        ``buffers`` bound at its index (setBuffer), each block of ``constants`` at its index
        (setBytes) and threadgroup memory lengths by index; returns the buffers as the kernel
        left them (new arrays of the same dtypes and shapes)."""
        jobs = jobs or min(4, os.cpu_count() or 1)
        with tempfile.TemporaryDirectory(prefix="metal_emu_") as tmp:
            args = [
                str(self.exe),
                "--kernel",
                kernel,
                "--grid",
                ",".join(str(int(x)) for x in grid),
                "--threads",
                ",".join(str(int(x)) for x in threads),
                "--schedule",
                schedule,
                "--layout-seed",
                str(int(layout_seed)),
                "--jobs",
                str(int(jobs)),
            ]
            files = {}
            for index, block in constants.items():
                path = Path(tmp) / f"bytes{index}.bin"
                path.write_bytes(bytes(block))
                args += ["--bytes", f"{index}={path}"]
            for index, array in buffers.items():
                path = Path(tmp) / f"buffer{index}.bin"
                path.write_bytes(np.ascontiguousarray(array).tobytes())
                files[index] = (path, array)
                args += ["--buffer", f"{index}={path}"]
            for index, length in threadgroup_memory.items():
                args += ["--tgmem", f"{index}={int(length)}"]
            run = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if run.returncode != 0:
                raise EmulatorError(
                    f"{kernel} failed in the emulator (status {run.returncode}):\n{run.stderr.strip()}"
                )
            return {
                index: np.frombuffer(path.read_bytes(), dtype=array.dtype).reshape(array.shape).copy()
                for index, (path, array) in files.items()
            }

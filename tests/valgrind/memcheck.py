"""Run Python tests under valgrind memcheck and judge the library, not the interpreter.

    python tests/valgrind/memcheck.py                 # the CI subset
    python tests/valgrind/memcheck.py --durations=5   # the subset, with pytest options
    python tests/valgrind/memcheck.py tests/ -x       # anything pytest takes

The run fails when valgrind reports an error (invalid read, write or free, uninitialised
value, definite leak, ...) any of whose stacks passes through the library (lib_native,
mlx_native): where it happened, or where the memory involved was allocated or freed.
Errors wholly inside CPython, numpy or libc are known noise: ``python.supp`` suppresses
the common ones and the rest are counted and reported, not failed on.
PYTHONMALLOC=malloc puts every Python allocation in front of valgrind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

#: The CI subset (about 3 minutes on 2 cores): bindings, validation, lifetimes, a short
#: fuzz, threads closing objects under each other, and one case of each numerical edge.
SUBSET = [
    "tests/test_bindings.py",
    "tests/test_validation.py",
    "tests/test_lifetime.py",
    "tests/test_edge_cases.py",
    "tests/test_fuzz.py",
    "tests/test_threads.py",
    "-k",
    "not cli and (test_bindings or test_validation or test_lifetime or test_fuzz or under_another"
    " or (poisons_exactly and nan) or (nan_in_k and mixed) or (non_finite_v and nan) or (mask_poisons and nan)"
    " or all_minus_inf or only_by_minus or strides_at or (one_cache_row and 1-1-8-2-512))",
]


def _has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return {"avx2", "fma", "f16c"} <= set(flags)


#: Frames of the library: the cdylib and its Rust symbols.
LIBRARY = ("lib_native", "mlx_native")


def frames(error):
    for f in error.iter("frame"):
        yield " ".join((f.findtext(t) or "") for t in ("obj", "fn", "file"))


def in_library(error) -> bool:
    return any(any(m in fr for m in LIBRARY) for fr in frames(error))


def describe(error) -> str:
    what = error.findtext("what") or error.findtext("xwhat/text") or error.findtext("kind")
    stack = "\n      ".join(list(frames(error))[:12])
    return f"{error.findtext('kind')}: {what}\n      {stack}"


def main() -> int:
    args = sys.argv[1:]
    if all(a.startswith("-") for a in args):  # only options: for the subset
        args = list(SUBSET) + args
        if _has_avx2():
            # One CPU kernel family: the SIMD one (valgrind hides AVX-512: AVX2+FMA+F16C).
            args[args.index("-k") + 1] = f"not portable and ({args[args.index('-k') + 1]})"
    if shutil.which("valgrind") is None:
        print("memcheck: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    fd, xml = tempfile.mkstemp(prefix="mlxn-memcheck-", suffix=".xml")
    os.close(fd)
    cmd = [
        "valgrind", "--tool=memcheck", "--leak-check=full", "--show-leak-kinds=definite",
        "--errors-for-leak-kinds=definite", "--num-callers=40", "--child-silent-after-fork=yes",
        f"--suppressions={os.path.join(HERE, 'python.supp')}", "--xml=yes", f"--xml-file={xml}",
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
    ]
    env = dict(os.environ, PYTHONMALLOC="malloc")
    env.setdefault("MLXN_FUZZ_CASES", "25")
    print("memcheck:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, env=env, cwd=ROOT)
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError as e:
        print(f"memcheck: no readable valgrind report ({e})", file=sys.stderr)
        return 3
    finally:
        os.unlink(xml)
    bad, noise = [], {}
    for error in root.iter("error"):
        kind = error.findtext("kind") or "?"
        if in_library(error):
            bad.append(error)
        else:
            noise[kind] = noise.get(kind, 0) + 1
    suppressed = sum(int(p.findtext("count") or 0) for p in root.iter("pair"))
    print(f"memcheck: pytest exit {rc}; {len(bad)} errors in or against the library; "
          f"outside the library (interpreter, numpy, libc; not counted): {noise or 'none'}; "
          f"suppressed: {suppressed}")
    for error in bad:
        print("  " + describe(error))
    if rc != 0:
        print("memcheck: the tests themselves failed under valgrind", file=sys.stderr)
        return rc
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

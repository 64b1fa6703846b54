"""The mutation catalog (scripts/mutate_kernels.py) still plants every bug it records: each
mutation's original text occurs in its kernel source as many times as recorded. A kernel
change that rewrites such a line without updating the catalog fails here, not on the next
mutation run (docs/reliability.md, Commands)."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _catalog():
    spec = importlib.util.spec_from_file_location("mutate_kernels", ROOT / "scripts" / "mutate_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_mutation_still_applies():
    mk = _catalog()
    assert len(mk.MUTATIONS) > 100
    stale = {m.name: why for m in mk.MUTATIONS if (why := mk.applies(m))}
    assert not stale, stale


def test_a_rewritten_line_is_named(tmp_path):
    # The check itself: a source whose recorded line was rewritten is reported, by file.
    mk = _catalog()
    m = next(m for m in mk.MUTATIONS if m.family == "cuda")
    copy = tmp_path / m.file
    copy.parent.mkdir(parents=True)
    copy.write_text((ROOT / m.file).read_text().replace(m.original, "/* rewritten */"))
    why = mk.applies(m, root=tmp_path)
    assert why is not None and m.file in why and "occurs 0 times" in why, why
    assert mk.applies(m) is None

"""Every probe of the hostile-input catalogue (``tests/hostile_probes.py``) gives the
reference's result or a typed error, as it says."""

from __future__ import annotations

import pytest

import hostile_probes
from helpers import import_test_extra

import_test_extra("torch")  # the catalogue's torch probes

PROBES = hostile_probes.probes()


@pytest.mark.parametrize("probe", PROBES, ids=[p.name for p in PROBES])
def test_the_probe_gives_what_it_says(probe):
    try:
        outcome = hostile_probes.run(probe)
    finally:
        import mlx_native as mn

        mn.force_cpu_isa(None)
        mn.set_num_threads(None)
    assert outcome == ("typed" if probe.check is None else "result"), outcome


def test_the_catalogue_is_large_and_mixed():
    # Most probes are mistakes; a fair share are edges that must still compute.
    due = [p.check is not None for p in PROBES]
    assert len(PROBES) >= 150 and sum(due) >= 30 and len(due) - sum(due) >= 100

"""The store checked against a dict by a Hypothesis state machine (lcache.testing.stateful)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from lcache.testing.stateful import StoreMachine

pytestmark = pytest.mark.slow


def test_store_matches_dict_through_crashes_and_eviction(tmp_path: Path) -> None:
    run_state_machine_as_test(
        lambda: StoreMachine(tmp_path),
        settings=settings(
            max_examples=200,  # about 20 s on a 2-core machine; the bound is 60 s
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )

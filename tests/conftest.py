"""Shared test setup: deterministic seeds, a hypothesis profile for CI, fresh Dynamo state per test."""

import os

import pytest
import torch
import torch._inductor.config
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("CKVP_HYPOTHESIS_EXAMPLES", "6")),  # (CKVP_HYPOTHESIS_EXAMPLES=50: a deeper run)
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Inductor's C++ kernels compiled in the test process, not in a pool of compile workers: pytest-xdist already keeps
# every core busy, and the pool's start-up and hand-offs cost a full-Inductor test ~15% more CPU time on 2 cores
torch._inductor.config.compile_threads = 1


@pytest.fixture(autouse=True)
def _seed_and_reset():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()

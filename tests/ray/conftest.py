from __future__ import annotations

import pytest
import ray


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the session (2 CPUs here; engines ask for 1 each)."""
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False, num_cpus=4)
    yield
    ray.shutdown()

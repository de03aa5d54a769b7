"""Test setup: JAX must see 8 CPU devices, which has to be set before JAX initializes."""

import os

# Idempotent: pytest-xdist's workers inherit the controller's environment, set here already.
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session", autouse=True)
def _eight_devices() -> None:
    assert jax.device_count() == 8, "tests need 8 simulated CPU devices"



# Parallel runs (`make test`: pytest-xdist with --dist loadfile --no-loadscope-reorder). Each test
# file runs on one worker, in file order, so its module-scoped fixtures and the programs its
# tests compile are made once per run, not once per worker. Files go out to the workers in
# collection order, so the slowest go first: no long file starts last while the other worker
# idles. Approximate serial seconds of the slowest files with HYPOTHESIS_PROFILE=ci; only the
# order depends on these figures (a stale entry costs some balance, never a test).
SLOW_FILES = {  # seconds of a -n 2 run at load average 6-15 (CI on 2 cores, 1906 s wall)
    "test_redistribute.py": 1078,
    "test_frameworks.py": 163,
    "test_inference_programs.py": 162,
    "test_schedules.py": 155,
    "test_benchmarks.py": 145,
    "test_operators.py": 134,
    "test_properties.py": 130,
    "test_docs.py": 121,
    "test_dtensor.py": 114,
    "test_factories.py": 103,
    "test_models.py": 101,
    "test_packaging.py": 95,
    "test_parallelize.py": 87,
    "test_notebooks.py": 81,
    "test_training.py": 80,
    "test_strided_inference.py": 77,
    "test_train_demo.py": 69,
    "test_indexing.py": 61,
    "test_torch_dispatch.py": 60,
    "test_func_map.py": 58,
    "test_multiprocess.py": 54,
    "test_loss.py": 51,
    "test_checkpoint.py": 43,
    "test_torch_interop.py": 39,
    "test_inference_values.py": 39,
    "test_torch_checkpoint.py": 35,
    "test_autoplan.py": 35,
    "test_layout.py": 34,
    "test_comm_mode.py": 30,
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (every worker sorts alike)
        items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))  # stable: file order kept

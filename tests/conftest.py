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
# idles. Approximate seconds of the slowest files (junit times of whole -n 2 runs); only the
# order depends on these figures (a stale entry costs some balance, never a test).
SLOW_FILES = {  # seconds per file in a -n 2 run on 2 cores (junit times)
    # stop 29's clean-clone run of .ci/run (2,265 tests, 1,694 s of tests, 868 s wall, load ~1.5)
    "test_redistribute.py": 195,
    "test_operators.py": 190,
    "test_models.py": 184,
    "test_real_code.py": 161,
    "test_inference_carry.py": 101,
    "test_training.py": 92,
    "test_inference_programs.py": 90,
    "test_benchmarks.py": 64,
    "test_factories.py": 56,
    "test_inference_blocks.py": 55,
    "test_frameworks.py": 48,
    "test_notebooks.py": 47,
    "test_docs.py": 46,
    "test_dtensor.py": 39,
    "test_packaging.py": 30,
    "test_strided_inference.py": 29,
    "test_schedules.py": 23,
    "test_properties.py": 20,
    "test_loss.py": 18,
    "test_train_demo.py": 17,
    "test_checkpoint.py": 14,
    "test_func_map.py": 13,
    "test_autoplan.py": 12,
    "test_torch_checkpoint.py": 12,
    "test_torch_dispatch.py": 12,
    "test_register_sharding.py": 11,
    "test_cli.py": 9,
    "test_layout.py": 9,
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (every worker sorts alike)
        items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))  # stable: file order kept

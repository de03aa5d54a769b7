"""Test setup: JAX must see 8 CPU devices, which has to be set before JAX initializes."""

import os

# Idempotent: pytest-xdist's workers inherit the controller's environment, set here already.
if "--xla_force_host_platform_device_count=8" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# XLA's CPU code generation without LLVM's expensive passes (still at XLA's -O3): the HLO passes
# the tests check (SPMD partitioning, the collective combiners, fusion) run in full and compile
# the same optimized HLO, byte for byte on the GPT-2 and Llama training steps of tests/models,
# while each compile takes 0.7-0.85x as long (GPT-2's step 7.0 -> 5.0 s, Llama's 3.5 -> 3.0 s).
# The suite compiles a few thousand programs and runs each on tiny arrays, so compiling is most
# of its time. Lower LLVM levels compile faster (`--xla_backend_optimization_level=0` halves the
# compiles) but round differently: at -O0 a sharded `randn` is no longer bit-equal to the
# unsharded one nor a jitted gradient to the eager one (6 tests, 1-2 ulp), and at -O1 or -O2 a
# value of the CLIP step's updated vision key bias (tests/test_real_code.py) lands 1.05e-4 from
# the one-device step's, sign flipped, beyond the test's 1e-4: that bias's gradient is zero in
# exact arithmetic (a row's softmax ignores a shift all its keys share), so adamw's update of it
# is rounding noise scaled to ~lr, within the tolerance at -O3 by luck of the rounding (5.8e-5 of
# margin at worst here). Unlike the device count, a setting of it the caller gave wins (to run
# the tests at XLA's defaults). The benchmarks do not read this file: their compile times are
# XLA's defaults.
if "--xla_llvm_disable_expensive_passes=" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] += " --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

# One XLA compilation cache per run, shared by pytest-xdist's workers (they inherit the
# directory through the environment, set here by the controller first): many tests compile the
# same program (a model's step compiled by `check`, by plain `jax.jit` beside `apply`, and again
# in another test file), and XLA keys its executables by the optimized program and the compile
# options alone, so a second compile of the same program loads the first's executable. The
# directory starts empty (no executable from another run or version is ever read) and goes
# with the run. Only the test processes read it: the benchmarks, notebooks and subprocesses
# compile as users do.
# Measured on 2 cores (`make test`'s 2 workers, 2,657 tests): 3,264 -> 2,558 s of tests, 1,662 ->
# 1,306 s wall; the most on the files compiling whole training steps (test_real_code 720 -> 566 s).
_CACHE_VARIABLE = "PLACEMENTS2JAX_TEST_XLA_CACHE"
_OWNS_CACHE = _CACHE_VARIABLE not in os.environ
if _OWNS_CACHE:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="placements2jax-xla-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

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
    # stop 58's run of `make test`'s command at 6bc589f (2,835 tests, 4,987 s of tests, 2,568 s wall, load ~2.7)
    "test_real_code.py": 1025,
    "test_inference_programs.py": 556,
    "test_operators.py": 498,
    "test_redistribute.py": 296,
    "test_frameworks.py": 243,
    "test_models.py": 234,
    "test_inference_carry.py": 197,
    "test_training.py": 195,
    "test_inference_blocks.py": 134,
    "test_benchmarks.py": 129,
    "test_inference_simplify.py": 129,
    "test_schedules.py": 125,
    "test_factories.py": 95,
    "test_notebooks.py": 94,
    "test_properties.py": 83,
    "test_docs.py": 78,
    "test_inference_program.py": 69,
    "test_dtensor.py": 66,
    "test_strided_inference.py": 52,
    "test_logical.py": 52,
    "test_packaging.py": 42,
    "test_loss.py": 41,
    "test_autoplan.py": 39,
    "test_parallelize.py": 37,
    "test_func_map.py": 35,
    "test_inference_jaxpr.py": 32,
    "test_train_demo.py": 30,
    "test_inference_callbacks.py": 28,
    "test_torch_interop.py": 26,
    "test_inference_check.py": 25,
    "test_checkpoint.py": 24,
    "test_register_sharding.py": 22,
    "test_inference_values.py": 21,
    "test_inference_cost.py": 19,
    "test_inference_regions.py": 18,
    "test_torch_dispatch.py": 17,
    "test_torch_checkpoint.py": 16,
    "test_bad_inputs.py": 15,
    "test_cli.py": 15,
    "test_layout.py": 15,
    "test_caches.py": 15,
    "test_indexing.py": 13,
    "test_strided_layout.py": 13,
    "test_multiprocess.py": 12,
    "test_comm_mode.py": 10,
}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (every worker sorts alike)
        items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))  # stable: file order kept


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _OWNS_CACHE:  # the process that made the run's compilation cache (xdist's controller)
        shutil.rmtree(os.environ[_CACHE_VARIABLE], ignore_errors=True)

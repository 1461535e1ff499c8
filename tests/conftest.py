"""Shared test setup: deterministic seeds, a hypothesis profile for CI, fresh Dynamo state per test."""

import os

# pytest-xdist runs one worker a core: each worker's torch, the OpenMP loops of the C++ kernels Inductor compiles
# there, and the child processes its tests start get one thread, so that the workers' spinning OpenMP threads do not
# oversubscribe the cores (about 10% of the suite's CPU time on a 2-core CI machine)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch._inductor.config  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

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
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _seed_and_reset():
    torch.manual_seed(0)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


#: The slowest self-contained tests (30-90 s each on a 2-core CI machine; `.ci/run` lists the 80 slowest), longest
#: first. They run before the rest so that pytest-xdist's workers end on short tests instead of one worker finishing a
#: long one alone (longest-processing-time-first scheduling). Prefixes of node ids; a renamed test just keeps its
#: place. Only tests without module-scoped fixtures: moving one would build its module's fixture twice.
_RUN_FIRST = (
    "tests/e2e/test_latent_kv.py::test_fixture_latent_cache_compiles_with_inductor",
    "tests/kernels/test_sm90_compile.py::test_kernels_compile_for_sm90",
    "tests/kernels/test_latent_attention_triton.py::test_kernels_match_reference_under_interpreter",
    "tests/e2e/test_equivalence.py::test_fixture_model_full_inductor",
    "tests/kernels/test_latent_attention_words.py::test_words_kernel_matches_reference_under_interpreter",
    "tests/kernels/test_latent_attention_lanes.py::test_lanes_kernel_matches_reference_under_interpreter",
    "tests/kernels/test_latent_quant_triton.py::test_kernels_match_reference_under_interpreter",
    "tests/reliability/test_fuzz_latent.py::",
    "tests/reliability/test_cudagraph_capture_safety.py::test_gpu_capture_script_cpu_smoke",
    "tests/kernels/test_latent_attention_absorbed.py::test_absorbed_kernel_matches_reference_under_interpreter",
    "tests/kernels/test_latent_quant_triton_tern_mix.py::test_kernels_match_reference_under_interpreter",
    "tests/kernels/test_merge_splits.py::test_merges_match_reference_under_interpreter",
    "tests/kernels/test_latent_attention_f8.py::test_f8_latents_match_reference_under_interpreter",
)


def pytest_collection_modifyitems(config, items):
    """Run :data:`_RUN_FIRST` first, in its order; every other test keeps its collection order."""

    def rank(item) -> int:
        nodeid = item.nodeid.replace("\\", "/")
        return next((i for i, p in enumerate(_RUN_FIRST) if nodeid.startswith(p)), len(_RUN_FIRST))

    items.sort(key=rank)  # stable

import os

import pytest
import torch

HAS_GPU = torch.cuda.is_available()

requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm device (CI is CPU-only; run the suite on the H200)")


def pytest_report_header(config):
    if HAS_GPU:
        return f"mla: GPU {torch.cuda.get_device_name()} (GPU tests run)"
    return "mla: no GPU: GPU tests skip; CPU tests lower and compile the kernels for sm_90a"


def pytest_addoption(parser):
    parser.addoption(
        "--prebuild-only",
        action="store_true",
        help="build every kernel variant the collected GPU tests launch into TILELANG_CACHE_DIR, for the target "
        "$MLA_TARGET (default sm_90a; no GPU needed), then run no test: a cache to carry to the GPU host",
    )


def pytest_collection_modifyitems(session, config, items):
    if not config.getoption("--prebuild-only"):
        return
    from helpers import classes_of_items, prebuild
    from mla.target import spec_for_name

    prebuild(classes_of_items(items), spec=spec_for_name(os.environ.get("MLA_TARGET", "sm_90a")))
    config.hook.pytest_deselected(items=list(items))
    items[:] = []


@pytest.fixture(scope="module", autouse=True)
def kernels_prebuilt(request):
    """Builds, in parallel, every kernel variant this module's selected GPU tests declared (``helpers.launches``)."""
    if not HAS_GPU:
        return
    from helpers import classes_of_items, prebuild

    classes = classes_of_items(item for item in request.session.items if item.module is request.module)
    if classes:
        capture = request.config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            prebuild(classes, log=lambda line: print(f"\n{line}", flush=True))


def pytest_sessionfinish(session, exitstatus):
    """Stop the compile worker processes torch.compile started (the torch.compile tests start them): left running,
    they compete with whatever runs next on the host, e.g. a benchmark (docs/perf.md, runs 7, 9 and 11)."""
    import sys

    async_compile = sys.modules.get("torch._inductor.async_compile")
    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()

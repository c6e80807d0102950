import pytest
import torch

HAS_GPU = torch.cuda.is_available()

requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm device (CI is CPU-only; run the suite on the H200)")


def pytest_report_header(config):
    if HAS_GPU:
        return f"mla: GPU {torch.cuda.get_device_name()} (GPU tests run)"
    return "mla: no GPU: GPU tests skip; CPU tests lower and compile the kernels for sm_90a"

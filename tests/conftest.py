import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without a GPU, Triton kernels run in the interpreter on CPU tensors. The flag must be set before
# any kernel module is imported (triton.jit reads it when decorating).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

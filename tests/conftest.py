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


@pytest.fixture(scope="module")
def golden_ckpts(tmp_path_factory):
    """(case, conversion="exact", tp, ep) -> (checkpoint, stored reference file); one source per case
    and test module (verify/golden.py ``materialize``)."""
    from gptoss_fp8.verify import golden

    work = {}

    def get(name, conversion="exact", tp=1, ep=1):
        if name not in work:
            work[name] = tmp_path_factory.mktemp(name)
        return golden.materialize(name, work[name], conversion, tp, ep)

    return get

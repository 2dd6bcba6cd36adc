import os
import random
import zlib

import numpy as np
import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without a GPU, Triton kernels run in the interpreter on CPU tensors. The flag must be set before
# any kernel module is imported (triton.jit reads it when decorating).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (README command 2: -n 2) each worker gets its share of the cores, so the
# workers' torch thread pools do not oversubscribe the box.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


# Each test's random draws come from a seed of its own: the run's seed (fresh each run, printed in the
# header; GPTOSS_TEST_SEED=N repeats it) mixed with the test's id. A failure on rare inputs then repeats
# with `GPTOSS_TEST_SEED=N pytest NODEID`, whatever the order or the worker the test ran in.
_SEED_ENV = "GPTOSS_TEST_SEED"


def _run_seed(config) -> int:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller's seed
        return int(config.workerinput[_SEED_ENV])
    if not hasattr(config, "_gptoss_seed"):
        env = os.environ.get(_SEED_ENV)
        config._gptoss_seed = int(env) if env else random.SystemRandom().randrange(2**31)
    return config._gptoss_seed


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # xdist controller, once per worker
    node.workerinput[_SEED_ENV] = str(_run_seed(node.config))


def _seed_line(config) -> str:
    seed = _run_seed(config)
    return f"test seed: {seed} (to repeat a failure: {_SEED_ENV}={seed} pytest NODEID)"


def pytest_report_header(config):
    return _seed_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # also under -q, where the header is not
    if exitstatus not in (0, 5):  # 5: nothing collected
        terminalreporter.write_line(_seed_line(config))


def pytest_runtest_setup(item):
    # before the item's fixtures are set up, so a fixture it builds first draws from this seed too
    s = (_run_seed(item.config) * 1_000_003 + zlib.crc32(item.nodeid.encode())) % 2**32
    random.seed(s)
    np.random.seed(s)
    torch.manual_seed(s)


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


def fail_writes_with_enospc(monkeypatch, on_write: int) -> None:
    """Make every StreamingWriter's file fail with ENOSPC on its ``on_write``-th write (a full disk
    in the middle of a file)."""
    import errno

    from gptoss_fp8.checkpoint import st_io

    class FullDisk:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += 1
            if self.n == on_write:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, k):
            return getattr(self.f, k)

    real_init = st_io.StreamingWriter.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self._f = FullDisk(self._f)

    monkeypatch.setattr(st_io.StreamingWriter, "__init__", init)


@pytest.fixture(scope="session")
def harmony_ckpt(tmp_path_factory):
    """A tiny converted checkpoint with the tokenizer's 201088-token vocabulary (serve tests)."""
    from serve_util import make_harmony_checkpoint

    return make_harmony_checkpoint(tmp_path_factory.mktemp("harmony"))


@pytest.fixture
def client(server):
    """The official openai client on the requesting module's ``server`` (a serve_util.running_server)."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def script(server, monkeypatch):
    """script(text) -> the prompts the engine of the module's ``server`` saw; every request then gets text's ids as
    its reply (serve_util.scripted)."""
    from serve_util import scripted

    return scripted(server.served.engine, monkeypatch)


# The trained fixture (golden/trained: a 4-layer gpt-oss trained on Python source, byte-level) on a
# fixed piece of Python, 125 bytes: longer than its sliding window (64), so the window matters.
TRAINED_TEXT = '''def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


print([fib(i) for i in range(12)])
'''


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """(converted checkpoint (default conversion), source, tokens int64 [125], OpenAI's reference on
    them with the conversion's expected rounding), made once per session."""
    from pathlib import Path

    from gptoss_fp8.convert.convert import convert_checkpoint
    from gptoss_fp8.tokenizer import ByteTokenizer
    from gptoss_fp8.verify.reference import reference_for
    from gptoss_fp8.verify.report import rounding_for

    src = Path(__file__).resolve().parents[1] / "golden" / "trained"
    dst = tmp_path_factory.mktemp("trained") / "fp8"
    convert_checkpoint(src, dst)
    tokens = torch.tensor(ByteTokenizer().encode(TRAINED_TEXT), dtype=torch.long)
    rounding, exact = rounding_for(dst)
    return dst, src, tokens, reference_for(src, tokens, "cpu", None if exact else rounding)

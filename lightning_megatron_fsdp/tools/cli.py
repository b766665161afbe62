"""The ``lightning-megatron-fsdp`` console script: ``consolidate``, ``export-lightning`` and
``inspect`` checkpoints offline, in one process without a GPU or a process group, importing
neither Lightning nor megatron-fsdp; every path may be a URL (``s3://...``), configured by the
filesystem's own settings (the ``AWS_*`` variables for s3fs). Exit status 0 on success, 1 when
a checkpoint or output is rejected, 2 for a usage error, 141 when the reader of its output
went away (``inspect ... | head``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import select
import signal
import sys
import warnings
from typing import TYPE_CHECKING, Any, TextIO

from typing_extensions import override

if TYPE_CHECKING:
    from lightning_megatron_fsdp.tools.inspection import CheckpointInfo

__all__ = ["build_parser", "main"]

PROG = "lightning-megatron-fsdp"
SIGPIPE_STATUS = 128 + signal.SIGPIPE
"""The status when stdout's reader went away, as a shell reports a tool SIGPIPE killed."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the console script (exposed for documentation tools)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Export and inspect lightning-megatron-fsdp checkpoints offline.",
    )
    parser.add_argument(
        "--version",
        action=_PrintVersions,
        help="print the versions of this package, torch, Lightning and megatron-fsdp, and exit",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    consolidate = commands.add_parser(
        "consolidate",
        help="write the full, unsharded weights to one .safetensors or .pt file",
        description=(
            "Write a checkpoint's unsharded tensors to OUTPUT, streaming one tensor at a "
            "time. The suffix chooses the format: .safetensors, or .pt/.pth/.bin for "
            "torch.save. Keys are the model's parameter names, so the file loads with "
            "model.load_state_dict into the unsharded model."
        ),
    )
    _add_paths_and_dtype(consolidate)
    what = consolidate.add_mutually_exclusive_group()
    what.add_argument(
        "--optimizer",
        action="store_true",
        help="also export optimizer state, under keys 'optimizer_states.<i>.'",
    )
    what.add_argument(
        "--strip-prefix",
        metavar="PREFIX",
        help=(
            "export only the model entries under PREFIX (e.g. 'model.'), without it: the "
            "state dict of the module the LightningModule holds there"
        ),
    )
    _add_output_options(consolidate)

    lightning = commands.add_parser(
        "export-lightning",
        help="write a single-file Lightning checkpoint for Model.load_from_checkpoint",
        description=(
            "Write the checkpoint as one torch.save file in Lightning's format: the "
            "LightningModule's state_dict with full tensors, hyper-parameters, epoch, "
            "global step, versions and the rest of the training state, streaming one "
            "tensor at a time. Model.load_from_checkpoint(OUTPUT) then loads it in one "
            "process, without a GPU."
        ),
    )
    _add_paths_and_dtype(lightning)
    lightning.add_argument(
        "--optimizer",
        action="store_true",
        help="also write optimizer state (torch's format: a DDP or single-device run can resume)",
    )
    _add_output_options(lightning)

    inspect = commands.add_parser(
        "inspect",
        help="list tensors (shape, dtype, chunks) and the epoch, step and versions",
        description=(
            "Print each tensor's global shape, dtype and number of saved chunks, and the "
            "Lightning metadata (epoch, global step, versions, world size). Reads no tensor "
            "data, but compares the files' sizes with manifest.json: exit status 1 when one "
            "differs (then run --verify)."
        ),
    )
    inspect.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    inspect.add_argument("--json", action="store_true", help="print machine-readable JSON")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help=(
            "also check completeness, file sizes and checksums, printing the verdict first; "
            "exit 1 on problems"
        ),
    )
    inspect.add_argument(
        "--skip-checksums",
        action="store_true",
        help="with --verify: check sizes and completeness but not checksums",
    )
    for command in (consolidate, lightning, inspect):
        _add_safety_options(command)
    return parser


class _PrintVersions(argparse.Action):
    """``--version``: the installed versions on one line (argparse's own ``version`` action
    wraps it at the terminal width), read from package metadata alone (nothing imported)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    @override
    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        found = []
        for package in (PROG, "torch", "lightning", "megatron-fsdp"):
            try:
                found.append(f"{package} {importlib.metadata.version(package)}")
            except importlib.metadata.PackageNotFoundError:
                found.append(f"{package} (not installed)")
        print(f"{found[0]} ({', '.join(found[1:])})")
        parser.exit()


def _add_safety_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help=(
            "unpickle the checkpoint's pickles in full (runs any code they hold); only for "
            "a checkpoint from a source you trust. By default nothing from it runs"
        ),
    )
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error as well"
    )


def _add_paths_and_dtype(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR")
    parser.add_argument("output", metavar="OUTPUT")
    parser.add_argument(
        "--dtype",
        choices=["bf16", "fp16", "fp32"],
        help="cast floating-point model tensors (optimizer state keeps its dtype)",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true", help="replace OUTPUT if it exists")
    parser.add_argument(
        "--skip-checksums",
        action="store_true",
        help="do not compare checksums first (sizes and completeness are still checked)",
    )


def _format_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _format_name(data: dict[str, Any]) -> str | None:
    """``lightning-megatron-fsdp v1``, a recognised foreign format's name, or ``None``."""
    if data["format"] is None or data["format_version"] is None:
        return data["format"]
    return f"{data['format']} v{data['format_version']}"


def _print_table(info: CheckpointInfo, out: TextIO) -> None:
    data = info.to_json()
    fields: list[tuple[str, Any]] = [
        ("checkpoint", data["path"]),
        ("format", _format_name(data)),
        ("epoch", data["epoch"]),
        ("global_step", data["global_step"]),
        ("world_size", data["world_size"]),
        ("mesh", data["mesh"]),
        ("versions", ", ".join(f"{k} {v}" for k, v in data["versions"].items()) or None),
    ]
    for name, value in fields:
        print(f"{name:<12} {'unknown' if value is None else value}", file=out)
    for note in info.notes:
        print(f"{'note':<12} {note}", file=out)
    rows = [
        (t.key, str(t.shape), str(t.dtype).removeprefix("torch."), t.chunks) for t in info.tensors
    ]
    header = ("key", "shape", "dtype", "chunks")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(3)]
    print("", file=out)
    for key, shape, dtype, chunks in [header, *rows]:
        print(
            f"{key:<{widths[0]}}  {shape:<{widths[1]}}  {dtype:<{widths[2]}}  {chunks}",
            file=out,
        )
    total = sum(t.nbytes for t in info.tensors)
    elements = sum(t.numel for t in info.tensors)
    print(
        f"\n{len(info.tensors)} tensors, {elements:,} elements ({_format_bytes(total)}); "
        f"{len(info.objects)} non-tensor entries",
        file=out,
    )


def _inspect(args: argparse.Namespace) -> int:
    from lightning_megatron_fsdp.errors import CheckpointError
    from lightning_megatron_fsdp.storage import MANIFEST_FILE, count, summarise
    from lightning_megatron_fsdp.tools.inspection import inspect_checkpoint, verify_checkpoint

    info: CheckpointInfo | None = None
    error: CheckpointError | None = None
    try:
        info = inspect_checkpoint(args.checkpoint, trust_checkpoint=args.trust_checkpoint)
    except CheckpointError as err:
        error = err
    problems = (
        verify_checkpoint(
            args.checkpoint,
            checksums=not args.skip_checksums,
            trust_checkpoint=args.trust_checkpoint,
        )
        if args.verify
        else None
    )
    damaged = () if info is None else info.damaged
    status = 1 if (error is not None or problems or damaged) else 0
    if args.json:
        data: dict[str, Any] = info.to_json() if info is not None else {"path": args.checkpoint}
        if error is not None:
            data["error"] = str(error)
        if problems is not None:
            data["verify"] = {"ok": not problems, "problems": problems}
        print(json.dumps(data, indent=2))
        return status
    if error is not None and (problems is None or problems == [str(error)]):
        # Nothing to describe and nothing the verdict would add (a path that does not exist,
        # a directory of checkpoints): the error, once.
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 1
    if problems is not None:  # the verdict first, so that a long table cannot bury it
        _print_verdict(problems, info, args.skip_checksums)
    if info is not None:
        if problems is not None:
            print("")
        _print_table(info, sys.stdout)
    if damaged and problems is None:
        files = count(len(damaged), "file")
        print(
            summarise(
                f"{PROG}: error: {args.checkpoint}: damaged: run --verify ({files} differ "
                f"from {MANIFEST_FILE})",
                list(damaged),
            ),
            file=sys.stderr,
        )
    return status


def _print_verdict(problems: list[str], info: CheckpointInfo | None, sizes_only: bool) -> None:
    from lightning_megatron_fsdp.storage import count

    if problems:
        print(f"verify: FAILED, {count(len(problems), 'problem')}:")
        for problem in problems:
            print(f"  - {problem}")
    elif info is not None and info.manifest is None:  # a recognised foreign format
        print(
            f"verify: OK ({info.source_format}: no manifest.json, so no sizes or checksums "
            "to compare; every stored item lies inside an existing file; every tensor's "
            "chunks tile it exactly once)"
        )
    else:
        what = "sizes" if sizes_only else "sizes and checksums"
        print(
            f"verify: OK (complete; every file matches manifest.json {what}; every "
            "tensor's chunks tile it exactly once)"
        )


def _consolidate(args: argparse.Namespace) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        status = _export(args)
    for warning in caught:
        if issubclass(warning.category, UserWarning):
            print(f"{PROG}: note: {warning.message}", file=sys.stderr)
    return status


def _export(args: argparse.Namespace) -> int:
    from lightning_megatron_fsdp.errors import CheckpointError
    from lightning_megatron_fsdp.storage import locate

    reading = {
        "dtype": args.dtype,
        "overwrite": args.overwrite,
        "verify_checksums": not args.skip_checksums,
        "trust_checkpoint": args.trust_checkpoint,
    }
    try:
        if args.command == "export-lightning":
            from lightning_megatron_fsdp.tools.lightning_checkpoint import (
                export_lightning_checkpoint,
            )

            output = export_lightning_checkpoint(
                args.checkpoint, args.output, optimizer=args.optimizer, **reading
            )
        else:
            from lightning_megatron_fsdp.tools.export import consolidate_checkpoint

            output = consolidate_checkpoint(
                args.checkpoint,
                args.output,
                include_optimizer=args.optimizer,
                strip_prefix=args.strip_prefix,
                **reading,
            )
    except (CheckpointError, ImportError, OSError, ValueError) as err:
        if args.debug:
            raise
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {output} ({_format_bytes(locate(output).size())})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the console script.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv[1:]``.

    Returns:
        The exit status (0 success, 1 rejected input or failed verification, 141 when the
        reader of stdout went away).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "inspect" and args.skip_checksums and not args.verify:
        parser.error(
            "inspect: --skip-checksums only applies with --verify (inspect alone "
            "compares no checksums); add --verify, or drop --skip-checksums"
        )
    try:
        if args.command in ("consolidate", "export-lightning"):
            return _consolidate(args)
        return _inspect(args)
    except BrokenPipeError as err:
        if not _stdout_reader_gone():  # another connection broke (a bucket's): an error
            return _report(args, err)
        # `inspect ... | head`: the reader left, which is no error. Point stdout at
        # /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_STATUS
    except BaseException as err:  # any other failure on bad input: no traceback
        # (DCP's CheckpointException is a BaseException.)
        if args.debug or isinstance(err, KeyboardInterrupt | SystemExit | GeneratorExit):
            raise
        return _report(args, err)


def _report(args: argparse.Namespace, err: BaseException) -> int:
    if args.debug:
        raise err
    message = f"{args.checkpoint}: {type(err).__name__}: {err}{_hint(err)}"
    if getattr(args, "json", False):
        print(json.dumps({"path": args.checkpoint, "error": message}, indent=2))
    else:
        print(f"{PROG}: error: {message} (rerun with --debug for the traceback)", file=sys.stderr)
    return 1


def _hint(err: BaseException) -> str:
    """What to do about a failure whose own message does not say (botocore's missing
    credentials, raised through s3fs), matched by class name so botocore is not imported."""
    if any(cls.__name__ == "NoCredentialsError" for cls in type(err).__mro__):
        return (
            "; the bucket's credentials come from the standard AWS variables: set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for an "
            "S3-compatible server), or AWS_PROFILE for a profile in ~/.aws"
        )
    return ""


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end is closed (``poll`` reports
    an error on it), rather than a file or a reader still there."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (captured), no poll
        return False


if __name__ == "__main__":
    sys.exit(main())

"""The `offload-core` command: `backends` (what can run here) and `bench` (move blocks, verify,
report)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence

from offload_core import __version__, bench, native, registry
from offload_core.errors import OffloadError
from offload_core.hostmem import gib


def _table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # the `cli` extra is optional: fall back to plain columns
        cells = [list(map(str, headers))] + [[str(c) for c in r] for r in rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
        if title:
            print(title)
        for r in cells:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        return

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich's own answer is exit(1), which `bench` means as a mismatch
            raise BrokenPipeError("Broken pipe")

    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h)
    for r in rows:  # as text, not markup: a reason may hold brackets or :colons: of its own
        table.add_row(*(Text(str(c)) for c in r))
    _Console(emoji=False).print(table)


def _progress(enabled: bool):
    if enabled:
        with contextlib.suppress(ImportError):
            from rich.progress import track

            return lambda it: track(it, description="offloading", transient=True)
    return lambda it: it


def cmd_backends(args: argparse.Namespace) -> int:
    avail = registry.availability()
    problem = None
    try:
        selected = registry.select_backend_name()
    except OffloadError as exc:
        selected, problem = None, str(exc)
    by = f"${registry.ENV_BACKEND}" if os.environ.get(registry.ENV_BACKEND) else "the highest priority available"
    if selected is not None and avail.get(selected) is not None:
        hint = registry.backend_class(selected).install_hint
        problem = f"the selected backend {selected!r} ({by}) cannot run here: {avail[selected]}" + (
            f"; install: {hint}" if hint else ""
        )
    compiled = native.status()
    if args.json:
        print(json.dumps({"selected": selected, "selected_by": by, "backends": avail, "compiled_steps": compiled}))
    else:
        rows = []
        for name, reason in avail.items():
            try:
                priority = registry.backend_class(name).priority
            except OffloadError:  # a plugin that cannot be imported, or is not a backend
                priority = "-"
            available = "yes" if reason is None else "no"
            rows.append(("*" if name == selected else "", name, available, priority, reason or ""))
        _table("offload-core backends (* = selected)", ["", "name", "available", "priority", "reason"], rows)
        if selected is not None:
            print(f"selected: {selected}, by {by}" + ("" if by.startswith("$") else " (ties go by name)"))
        why = {
            "not built": " (no C compiler at install: the hot path runs in numpy)",
            "off": f" (${native.ENV_NATIVE}=0)",
        }
        print(f"compiled steps: {compiled}{why.get(compiled, '')}")
    if problem is not None:
        print(f"offload-core backends: {problem}", file=sys.stderr)
        return 1
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    native.load()  # a malformed $OFFLOAD_CORE_NATIVE is refused here as in `backends`, used or not

    # 16 per job, but a short run is still one job rather than an error
    per_job = args.blocks_per_job or min(DEFAULT_BLOCKS_PER_JOB, args.blocks)
    # checked here too, to name the options rather than `bench.run`'s arguments
    bench.check_whole(
        {"--blocks": args.blocks, "--blocks-per-job": per_job, "--blocks-per-chunk": args.blocks_per_chunk}, " "
    )
    result = bench.run(
        args.backend,
        preset=args.preset,
        blocks=args.blocks,
        blocks_per_job=per_job,
        blocks_per_chunk=args.blocks_per_chunk,
        iters=args.iters,
        progress=_progress(not args.json and sys.stderr.isatty()),
    )
    if args.json:
        print(json.dumps(result))
    else:
        header, rows, notes = bench_report(result)
        print(header)
        _table("", BENCH_COLUMNS, rows)
        for line in notes:
            print(line)
    return 0 if result["verified"] else 1


DEFAULT_BLOCKS_PER_JOB = 16
BENCH_COLUMNS = ("direction", "GB/s", "limit GB/s", "of limit", "descriptors/job", "mean copy")


def bench_report(r: dict) -> tuple[str, list[tuple[str, ...]], list[str]]:
    """The header line, one table row per direction (`BENCH_COLUMNS`) and the lines under the table
    (a footnote where a ratio shows above 100%, its cell marked ``*``; plan+submit time and the
    verdict) of `bench.run`'s result."""
    memory = f"{gib(r['host_memory_bytes'])} host"
    if r["device_memory_bytes"]:
        memory += f" and {gib(r['device_memory_bytes'])} device"
    header = (
        f"backend {r['backend']} on {r['device']}, preset {r['preset']}: {r['blocks']} blocks, "
        f"{r['blocks_per_job']} per job ({r['bytes_per_job'] / 2**20:.1f} MiB), "
        f"blocks_per_chunk {r['blocks_per_chunk']}, best of {r['iters']}; uses {memory} memory"
    )
    rows = []
    for d in ("store", "load"):
        percent = round(r[f"{d}_ratio"] * 100)
        rows.append(
            (
                d,
                f"{r[f'{d}_gbps']:.2f}",
                f"{r[f'{d}_limit_gbps']:.2f}",
                f"{percent}%*" if percent > 100 else f"{percent}%",
                f"{r[f'{d}_descriptors_per_job']:.0f}",
                _size(r[f"{d}_mean_copy_bytes"]),
            )
        )
    notes = []
    if any(row[3].endswith("*") for row in rows):
        notes.append(
            "* above 100%: jobs back to back overlap their host work with the copies; "
            f"the limit is the best of {r['limit_copies']} single copies of the same bytes"
        )
    verified = "every byte" if r["verified"] else "MISMATCH"
    notes.append(f"plan+submit {r['plan_submit_us_per_job']:.0f} us per job; verified: {verified}")
    return header, rows, notes


def _positive_int(text: str) -> int:
    """argparse type: the option's name is added by argparse in front of the message."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _size(nbytes: float) -> str:
    """Bytes in the largest unit that keeps the figure at 1 or more: B, KiB, MiB, GiB."""
    for unit in ("B", "KiB", "MiB"):
        if nbytes < 1024:
            return f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.0f} GiB"


class _OutputError(Exception):
    """Writing the command's output failed (a closed pipe, a full disk)."""


class _Output:
    """The standard output, whose write failures are told apart from the command's own."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._guarded(lambda: self._stream.write(text))

    def flush(self) -> None:
        self._guarded(lambda: self._stream.flush())

    def _guarded(self, call):
        if self._stream is None:  # started with its standard output closed
            raise _OutputError("the standard output is closed")
        try:
            return call()
        except OSError as exc:
            raise _OutputError(exc.strerror or str(exc)) from exc

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `offload-core` command.

    Returns:
        The exit status: 0 on success, 1 when `bench` finds a byte that differs or `backends`
        finds the selected backend unknown or unusable, 2 for input that cannot be run
        (argparse exits 2 itself for malformed options or a missing command), 3 when the
        output cannot be written (a closed pipe, a full disk), 130 when interrupted.
    """
    stdout, sys.stdout = sys.stdout, _Output(sys.stdout)
    try:
        status = _run(argv)
        sys.stdout.flush()
        return status
    except _OutputError as exc:
        # what is still buffered would fail again at exit, with a traceback
        with contextlib.suppress(OSError, ValueError, AttributeError):  # AttributeError: no stdout at all
            os.dup2(os.open(os.devnull, os.O_WRONLY), stdout.fileno())
        print(f"offload-core: cannot write the output: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:  # Ctrl-C during a long bench is an answer, not a crash
        print("offload-core: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


def _run(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="offload-core", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser(
        "backends",
        help="list every backend: available or not, why, which one is selected",
        description=(
            "List every registered backend (built in, or a plugin's entry point): whether it can run here and "
            "why not, and which one is selected: $OFFLOAD_CORE_BACKEND, else the available one of the highest "
            "priority, ties by name. Also says whether the compiled steps were built. Exit status 1 where the "
            "selection names an unknown backend or one that cannot run here, 2 where a setting is malformed."
        ),
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    p.set_defaults(func=cmd_backends)
    p = sub.add_parser(
        "bench",
        help="store blocks to host and load them back, verify every byte, report GB/s",
        description=(
            "Store blocks of a synthetic KV cache to host memory and load them back elsewhere, verify every "
            f"byte, and report GB/s next to the limit (the best of {bench.LIMIT_COPIES} single copies of the same "
            "bytes). Needs about 5 x blocks x the preset's block size of memory (host memory on the cpu "
            "backend); a run that would not fit is refused."
        ),
        epilog=(
            "Columns: GB/s of the stores and of the loads; the limit and its share; descriptors/job, the copies "
            "a job became after merging contiguous runs; mean copy, their average size. 'plan+submit' is the "
            "median host time of a job's submit. With --json, <direction>_gbps is the table's (wall clock over the "
            "jobs), <direction>_device_gbps over the jobs' own device time (their transfer_time). Exit status: "
            "0 verified, 1 a byte differs, 2 options that "
            "cannot run, 3 output that cannot be written, 130 interrupted."
        ),
    )
    p.add_argument(
        "--backend",
        help="backend name, as `offload-core backends` lists them (default: $OFFLOAD_CORE_BACKEND, else "
        "the best available)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(bench.PRESETS),
        default="llama-8b",
        help="KV cache shape: Llama-3-8B, 2 MiB per block, as 64 tensors of 32 KiB pages or (cross-layer) "
        "one tensor (default: %(default)s)",
    )
    p.add_argument(
        "--blocks",
        type=_positive_int,
        default=64,
        help="device blocks stored and loaded per iteration; a multiple of --blocks-per-job (default: %(default)s)",
    )
    p.add_argument(
        "--blocks-per-job",
        type=_positive_int,
        help="device blocks per store or load job; a multiple of --blocks-per-chunk "
        f"(default: {DEFAULT_BLOCKS_PER_JOB}, or --blocks where that is fewer)",
    )
    p.add_argument(
        "--blocks-per-chunk", type=_positive_int, default=1, help="device blocks per host block (default: %(default)s)"
    )
    p.add_argument(
        "--iters", type=_positive_int, default=5, help="iterations; the best is reported (default: %(default)s)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    p.set_defaults(func=cmd_bench)
    args = parser.parse_args(argv)
    if args.command is None:  # no subcommand: say what there is, as argparse says the rest
        parser.print_usage(sys.stderr)
        print(f"offload-core: error: choose a command: {', '.join(sub.choices)} (offload-core --help)", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (OffloadError, ValueError) as exc:
        print(f"offload-core: {exc}", file=sys.stderr)
        return 2

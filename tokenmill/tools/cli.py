"""The `tokenmill` command: the flow's entry points for people.

Each subcommand is a thin shell over the Python API, so what a person runs
here is exactly what a script gets. A user error (bad config, missing input or tokenizer,
unreachable URL, an output path that is a file) ends in one `tokenmill: error: ...` line and
exit status 2, never a traceback; colour only on a terminal, and never under NO_COLOR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tokenmill.preprocess.config import PipelineConfig
from tokenmill.preprocess.engines.engine import ENGINES
from tokenmill.preprocess.inputs.records import ON_ERROR
from tokenmill.preprocess.presets import DEFAULT_CONFIGS, default_config
from tokenmill.storage.location import output_folder
from tokenmill.tools import mix
from tokenmill.tools.bucket import parse_storage_options


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tokenmill {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("preprocess", help="records -> shards")
    p.add_argument(
        "inputs",
        nargs="+",
        help=".jsonl/.json/.txt(.gz/.zst)/.parquet files or folders, or URLs (s3://..., via fsspec)",
    )
    p.add_argument(
        "-o", "--output", required=True, help="output dataset folder, or a URL (s3://bucket/prefix)"
    )
    p.add_argument("-c", "--config", help="PipelineConfig (.json or .yaml)")
    p.add_argument(
        "--type",
        choices=list(DEFAULT_CONFIGS),
        help="use the built-in config of a training type instead of --config",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        help="Hugging Face tokenizer folder, or a Hub name ORG/NAME[@REVISION] already in the "
        "local Hugging Face cache (HF_HUB_CACHE; never downloaded)",
    )
    p.add_argument(
        "--text-lines",
        action="store_true",
        help="a .txt input gives a record per line, not per file (input.text_unit: line)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker threads, 2 to a process or Ray task (default: all cores; with --engine ray, cluster CPUs - 1)",
    )
    p.add_argument("--on-error", choices=list(ON_ERROR), default="raise")
    p.add_argument("--engine", choices=list(ENGINES), default="local")
    p.add_argument("--ray-address", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    p.add_argument("--json", action="store_true", help="print the run's summary as JSON")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="do the run and print its summary and length histograms; write nothing",
    )
    storage_option(p)

    v = sub.add_parser("verify", help="check every shard's sizes, offsets and checksums")
    v.add_argument("dataset", help="a dataset folder, or its URL (s3://bucket/prefix, ...)")
    v.add_argument("--json", action="store_true", help="print the problems found as JSON")
    storage_option(v)

    x = sub.add_parser("index", help="write a dataset's shards.index, so that it opens in O(1)")
    x.add_argument("dataset", help="a dataset folder of bin shards (written before it had one)")

    i = sub.add_parser("inspect", help="per-domain counts, lengths, trained share, provenance")
    i.add_argument("dataset", help="a dataset folder, or its URL (s3://bucket/prefix, ...)")
    storage_option(i)
    i.add_argument("--json", action="store_true", help="print JSON for machines")
    i.add_argument(
        "--plot", metavar="PNG", help="write a length histogram and trained share picture"
    )

    s = sub.add_parser("show", help="one sample decoded, trained and masked tokens told apart")
    s.add_argument("target", help="a dataset folder or URL, or raw records (.jsonl/.json/.parquet)")
    storage_option(s)
    s.add_argument("--index", type=int, default=0)
    s.add_argument(
        "--type",
        choices=list(DEFAULT_CONFIGS),
        help="raw records: use this training type's built-in config",
    )
    s.add_argument("-c", "--config", help="raw records: a PipelineConfig file")
    s.add_argument("--tokenizer", help="tokenizer folder (default: the one the manifest names)")
    s.add_argument("--ids", action="store_true", help="print token ids too")
    s.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="auto: on a terminal, unless NO_COLOR is set",
    )

    e = sub.add_parser("export", help="a dataset as Megatron .bin/.idx or Hugging Face Arrow")
    e.add_argument("dataset")
    e.add_argument("--to", choices=["megatron", "hf"], required=True)
    e.add_argument(
        "-o",
        "--output",
        required=True,
        help="megatron: PREFIX (writes PREFIX.bin, PREFIX.idx); hf: a folder",
    )
    e.add_argument(
        "--tokens-only",
        action="store_true",
        help="megatron: export the tokens of a dataset with a loss mask (the mask is lost)",
    )
    e.add_argument("--overwrite", action="store_true", help="replace an earlier export")
    e.add_argument("--json", action="store_true", help="print what was written as JSON")

    m = sub.add_parser("import", help="a Megatron .bin/.idx corpus as tokenmill shards")
    m.add_argument("prefix", help="PREFIX of PREFIX.bin and PREFIX.idx")
    m.add_argument("-o", "--output", required=True, help="output dataset folder")
    m.add_argument("--max-tokens-per-shard", type=int, default=None)
    m.add_argument("--overwrite", action="store_true", help="replace a tokenmill dataset there")
    m.add_argument("--json", action="store_true", help="print the summary as JSON")

    d = sub.add_parser("demo", help="run the whole flow on the data shipped with tokenmill")
    d.add_argument("-o", "--output", default="out/demo")
    d.add_argument(
        "--steps", type=int, default=300, help="training steps (stopped and resumed halfway)"
    )
    d.add_argument("--workers", type=int, default=2, help="DataLoader workers")

    mix.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except BrokenPipeError:  # `tokenmill show ... | head`
        sys.stderr.close()
        return 0
    except (ValueError, OSError, IndexError, ImportError) as err:  # ConfigError, RecordError too
        for line in error_text(err).splitlines() or [type(err).__name__]:
            print(f"tokenmill: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tokenmill: interrupted", file=sys.stderr)
        return 130


def version() -> str:
    """The installed package's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("tokenmill")
    except PackageNotFoundError:
        from tokenmill import __version__

        return __version__


def error_text(err: BaseException) -> str:
    """What went wrong, for a person: an OS error as `path: reason`, not its errno tuple."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err)


def use_color(choice: str) -> bool:
    """Never under NO_COLOR (no-color.org), whatever was asked; auto: only on a terminal."""
    if os.environ.get("NO_COLOR"):
        return False
    return choice == "always" or (choice == "auto" and sys.stdout.isatty())


def print_result(result: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(result, indent=2) if as_json else text)


def storage_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an fsspec storage option for a URL (value read as JSON if it parses), "
        "such as endpoint_url=http://minio:9000; repeat for more",
    )


def cmd_preprocess(args: argparse.Namespace) -> int:
    from tokenmill.preprocess.run.pipeline import Pipeline

    if bool(args.config) == bool(args.type):
        raise ValueError("give exactly one of --config and --type")
    config = PipelineConfig.from_file(args.config) if args.config else default_config(args.type)
    if args.text_lines:
        data = config.model_dump(mode="json")
        data["input"]["text_unit"] = "line"
        config = PipelineConfig.from_dict(data)
    options = parse_storage_options(args.storage_option)
    pipeline = Pipeline(
        config,
        args.inputs,
        output_dir=args.output,  # a folder (checked as output_folder checks it) or a URL
        tokenizer_path=args.tokenizer,
        workers=args.workers,
        on_error=args.on_error,
        engine=args.engine,
        overwrite=args.overwrite,
        ray_address=args.ray_address,
        storage_options=options or None,
        dry_run=args.dry_run,
    )
    summary = pipeline.run()
    text = "\n".join([summary.format(), *split_lines(summary, config)])
    result = summary.as_dict()
    if args.dry_run:
        result["lengths"] = {k: dict(sorted(v.items())) for k, v in pipeline.lengths.items()}
        text = "\n".join([text, *length_lines(pipeline.lengths)])
    print_result(result, args.json, text)
    if not summary.records_written:  # a run that leaves nothing to train on is not a success
        where = "" if args.dry_run else f"; see {args.output.rstrip('/')}/rejects.jsonl"
        print(
            f"tokenmill preprocess: no record written: all {summary.records_read} dropped{where}",
            file=sys.stderr,
        )
        return 1
    return 0


def split_lines(summary: Any, config: PipelineConfig) -> list[str]:
    """Each split's ledger in total, where domains divide the splits (the summary prints the
    domains' own)."""
    from tokenmill.preprocess.document.cleaning import SPLITS, in_split
    from tokenmill.preprocess.ledger import Ledger

    if config.preprocessing.validation is None or config.output.domain_key is None:
        return []
    lines = []
    for split in SPLITS:
        total = Ledger()
        for data in in_split(summary.domains, split).values():
            total.add(Ledger.from_dict(data))
        lines += [f"split {split}:", *total.format(indent="  ")]
    return lines


def length_lines(lengths: dict[str, dict[int, int]]) -> list[str]:
    """A dry run's histograms: rows and documents by length in tokens, powers of two."""
    lines = []
    for kind, buckets in lengths.items():
        total = sum(buckets.values())
        lines.append(f"{kind} by length (tokens):")
        for bucket, count in sorted(buckets.items()):
            low = bucket // 2 + 1 if bucket > 1 else bucket
            bar = "#" * round(40 * count / total) if total else ""
            lines.append(f"  {low:>8,}-{bucket:<8,}{count:>10,}  {bar}")
    return lines


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from tokenmill.tools.bucket import inspect
    from tokenmill.tools.inspect import format_stats

    stats = inspect(args.dataset, parse_storage_options(args.storage_option), args.plot)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from tokenmill.tools.show import show

    config = None
    if args.config:
        config = PipelineConfig.from_file(args.config)
    elif args.type:
        config = default_config(args.type)
    options = parse_storage_options(args.storage_option) or None
    color = use_color(args.color)
    print(show(args.target, args.index, args.tokenizer, config, color, args.ids, options))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tokenmill.tools.bucket import verify

    problems = verify(args.dataset, parse_storage_options(args.storage_option) or None)
    text = "\n".join(
        [*problems, f"{args.dataset}: {'OK' if not problems else f'{len(problems)} problem(s)'}"]
    )
    result = {"dataset": args.dataset, "ok": not problems, "problems": problems}
    print_result(result, args.json, text)
    return 1 if problems else 0


def cmd_index(args: argparse.Namespace) -> int:
    from tokenmill.shards.index import INDEX_NAME, write_index

    write_index(Path(args.dataset))
    print(f"{Path(args.dataset) / INDEX_NAME}: written")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tokenmill.tools.convert import export_megatron
    from tokenmill.tools.hf_export import export_hf

    if args.to == "hf":
        if args.tokens_only:
            raise ValueError("--tokens-only is for --to megatron; --to hf keeps every key")
        result = export_hf(args.dataset, output_folder(args.output), overwrite=args.overwrite)
        text = (
            f"wrote {result['folder']}: {result['rows']:,} rows in {result['files']} Arrow "
            f"file(s), columns {', '.join(result['columns'])} (datasets.load_from_disk reads it)"
        )
    else:

        def warn(line: str) -> None:
            print(f"tokenmill: warning: {line}", file=sys.stderr)

        result = export_megatron(
            args.dataset, args.output, args.tokens_only, overwrite=args.overwrite, warn=warn
        )
        text = (
            f"wrote {result['bin']} and {result['idx']}: {result['documents']:,} documents, "
            f"{result['tokens']:,} tokens ({result['dtype']})"
        )
    print_result(result, args.json, text)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from tokenmill.tools.convert import import_megatron

    summary = import_megatron(
        args.prefix,
        output_folder(args.output),
        max_tokens_per_shard=args.max_tokens_per_shard,
        overwrite=args.overwrite,
    )
    print_result(summary.as_dict(), args.json, summary.format())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from tokenmill.tools.demo import run_demo

    def log(line: str) -> None:
        print(line, flush=True)

    run_demo(
        Path(args.output),
        steps=args.steps,
        stop_at=args.steps // 2,
        num_workers=args.workers,
        log=log,
    )
    return 0


COMMANDS = {
    "preprocess": cmd_preprocess,
    "inspect": cmd_inspect,
    "show": cmd_show,
    "verify": cmd_verify,
    "index": cmd_index,
    "mix": mix.main,
    "export": cmd_export,
    "import": cmd_import,
    "demo": cmd_demo,
}

"""The `tokenmill` command: the flow's entry points for people.

Each subcommand is a thin shell over the Python API, so what a person runs
here is exactly what a script gets.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill.preprocess.config import ConfigError, PipelineConfig
from tokenmill.preprocess.engine import ENGINES
from tokenmill.preprocess.presets import DEFAULT_CONFIGS, default_config
from tokenmill.preprocess.records import ON_ERROR, RecordError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("preprocess", help="records -> shards")
    p.add_argument(
        "inputs",
        nargs="+",
        help=".jsonl/.json(.gz/.zst)/.parquet files or folders, or URLs (s3://..., via fsspec)",
    )
    p.add_argument("-o", "--output", required=True, help="output dataset folder")
    p.add_argument("-c", "--config", help="PipelineConfig (.json or .yaml)")
    p.add_argument(
        "--type",
        choices=list(DEFAULT_CONFIGS),
        help="use the built-in config of a training type instead of --config",
    )
    p.add_argument("--tokenizer", required=True, help="Hugging Face tokenizer folder")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes (default: all cores); with --engine ray, actors (default: cluster CPUs - 1)",
    )
    p.add_argument("--on-error", choices=list(ON_ERROR), default="raise")
    p.add_argument("--engine", choices=list(ENGINES), default="local")
    p.add_argument("--ray-address", default=None)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")

    v = sub.add_parser("verify", help="check every shard's sizes, offsets and checksums")
    v.add_argument("dataset")

    i = sub.add_parser("inspect", help="per-domain counts, lengths, trained share, provenance")
    i.add_argument("dataset")
    i.add_argument("--json", action="store_true", help="print JSON for machines")
    i.add_argument(
        "--plot", metavar="PNG", help="write a length histogram and trained share picture"
    )

    s = sub.add_parser("show", help="one sample decoded, trained and masked tokens told apart")
    s.add_argument("target", help="a dataset folder, or raw records (.jsonl/.json/.parquet)")
    s.add_argument("--index", type=int, default=0)
    s.add_argument(
        "--type",
        choices=list(DEFAULT_CONFIGS),
        help="raw records: use this training type's built-in config",
    )
    s.add_argument("-c", "--config", help="raw records: a PipelineConfig file")
    s.add_argument("--tokenizer", help="tokenizer folder (default: the one the manifest names)")
    s.add_argument("--ids", action="store_true", help="print token ids too")
    s.add_argument("--color", choices=["auto", "always", "never"], default="auto")

    d = sub.add_parser("demo", help="run the whole flow on the data shipped with tokenmill")
    d.add_argument("-o", "--output", default="out/demo")
    d.add_argument(
        "--steps", type=int, default=300, help="training steps (stopped and resumed halfway)"
    )
    d.add_argument("--workers", type=int, default=2, help="DataLoader workers")

    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (
        ConfigError,
        RecordError,
        FileExistsError,
        FileNotFoundError,
        ValueError,
        IndexError,
        ImportError,
    ) as err:
        print(f"tokenmill {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tokenmill show ... | head`
        sys.stderr.close()
        return 0


def cmd_preprocess(args: argparse.Namespace) -> int:
    from tokenmill.preprocess.pipeline import Pipeline

    if bool(args.config) == bool(args.type):
        raise ValueError("give exactly one of --config and --type")
    config = PipelineConfig.from_file(args.config) if args.config else default_config(args.type)
    summary = Pipeline(
        config,
        args.inputs,
        output_dir=args.output,
        tokenizer_path=args.tokenizer,
        workers=args.workers,
        on_error=args.on_error,
        engine=args.engine,
        overwrite=args.overwrite,
        ray_address=args.ray_address,
    ).run()
    print(summary.format())
    if not summary.records_written:  # a run that leaves nothing to train on is not a success
        print(
            f"tokenmill preprocess: no record written: all {summary.records_read} dropped; "
            f"see {Path(args.output) / 'rejects.jsonl'}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from tokenmill.tools.inspect import dataset_stats, format_stats, plot_stats

    stats = dataset_stats(args.dataset)
    print(json.dumps(stats, indent=2) if args.json else format_stats(stats))
    if args.plot:
        plot_stats(args.dataset, stats, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from tokenmill.tools.show import show

    config = None
    if args.config:
        config = PipelineConfig.from_file(args.config)
    elif args.type:
        config = default_config(args.type)
    color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
    print(show(args.target, args.index, args.tokenizer, config, color, args.ids))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tokenmill.shards.verify import verify_dataset

    problems = verify_dataset(Path(args.dataset))
    for problem in problems:
        print(problem)
    print(f"{args.dataset}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


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
    "demo": cmd_demo,
}

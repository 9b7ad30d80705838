"""`tokenmill mix`: the realised mix of a recipe (docs/recipes.md), printed before training.

The mixture comes from a recipe file, or from the command line (`--source PATH:WEIGHT[:REPEATS]`
with `--type` and `--window-size`), not both; `--type`, `--window-size`, `--seed`, `--by` and
`--on-exhausted` given beside a file override its fields."""

from __future__ import annotations

import argparse
import json
from typing import Any

import yaml

from tokenmill.dataflow.distributors import MIXTURE_UNITS, ON_EXHAUSTED
from tokenmill.tools.recipe import Recipe, load_recipe, realised_mix


def add_parser(sub: Any) -> None:
    """The `mix` subcommand, on the `tokenmill` parser's subparsers."""
    m = sub.add_parser("mix", help="the realised mix of a recipe: samples and tokens per source")
    m.add_argument("recipe", nargs="?", help="recipe file (.yaml or .json)")
    m.add_argument(
        "--source",
        action="append",
        metavar="PATH:WEIGHT[:REPEATS]",
        help="a source on the command line (repeat it); REPEATS an int or null (unlimited), "
        "default 1",
    )
    m.add_argument("--type", dest="train_type", help="train_type of a command-line mixture")
    m.add_argument("--window-size", type=int, help="window_size of a command-line mixture")
    m.add_argument("--by", choices=list(MIXTURE_UNITS))
    m.add_argument("--on-exhausted", choices=list(ON_EXHAUSTED))
    m.add_argument("--seed", type=int)
    m.add_argument("--samples", type=_positive, help="report the first SAMPLES samples only")
    m.add_argument("--json", action="store_true", help="print the report as JSON")


def parse_source(text: str) -> dict[str, Any]:
    """PATH:WEIGHT[:REPEATS] as a recipe source; a URL's own colon is kept in its path."""
    parts = text.rsplit(":", 2)
    if len(parts) == 3 and _number(parts[1]):
        path, weight, repeats = parts[0], parts[1], yaml.safe_load(parts[2])
        return {"path": path, "weight": float(weight), "repeats": repeats}
    path, _, weight = text.rpartition(":")
    if not path or not _number(weight):
        raise ValueError(f"--source {text!r}: expected PATH:WEIGHT[:REPEATS]")
    return {"path": path, "weight": float(weight)}


def _positive(text: str) -> int:
    """--samples: a count of samples, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def recipe_of(args: argparse.Namespace) -> Recipe:
    """The recipe of the file and the flags (flags win)."""
    if args.recipe and args.source:
        raise ValueError("give a recipe file or --source flags, not both")
    if not args.recipe and not args.source:
        raise ValueError("give a recipe file, or --source PATH:WEIGHT[:REPEATS] flags")
    if args.recipe:
        recipe = load_recipe(args.recipe)
        data, base, origin = recipe.model_dump(), recipe.base, args.recipe
    else:
        data, base, origin = {"mixture": {}}, ".", "command line"
        data["mixture"]["sources"] = [parse_source(s) for s in args.source]
    top = {"train_type": args.train_type, "window_size": args.window_size, "seed": args.seed}
    data.update({k: v for k, v in top.items() if v is not None})
    mix = {"by": args.by, "on_exhausted": args.on_exhausted}
    data["mixture"].update({k: v for k, v in mix.items() if v is not None})
    return Recipe.from_dict(data, origin=origin, base=base)


def table(report: dict[str, Any]) -> str:
    """The report as a table: one row per source, then the total."""
    unit = report["by"]
    w = max([6, *(len(row["source"]) for row in report["sources"])])

    def cell(value: Any, form: str) -> str:
        return "-" if value is None else format(value, form)

    lines = [
        f"mix by {unit}, on_exhausted={report['on_exhausted']}",
        f"{'source':<{w}} {'weight':>7} {'repeats':>9} {'declared':>9} {'realised':>9} "
        f"{'samples':>9} {'tokens':>12} {'passes':>7}",
    ]
    for row in report["sources"]:
        repeats = "unlimited" if row["repeats"] is None else str(row["repeats"])
        lines.append(
            f"{row['source']:<{w}} {row['weight']:>7g} {repeats:>9} {row['declared']:>9.2%} "
            f"{row['realised']:>9.2%} {row['samples']:>9,} {cell(row['tokens'], ',d'):>12} "
            f"{cell(row['passes'], '.2f'):>7}"
        )
    lines.append(
        f"{'total':<{w}} {'':>7} {'':>9} {'':>9} {'':>9} {report['samples']:>9,} "
        f"{cell(report['tokens'], ',d'):>12}"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Print the realised mix (a table, or JSON with --json)."""
    report = realised_mix(recipe_of(args).distributor(), samples=args.samples)
    print(json.dumps(report, indent=1) if args.json else table(report))
    return 0

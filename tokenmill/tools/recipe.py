"""A training mix declared in a file: a recipe names preprocessed datasets (each checked by
its fingerprint on resume), their weights, how many passes each may take, and what happens
when one runs out; `Recipe.distributor()` builds the MixtureDistributor, `realised_mix` says
what it will give. It lives in tools/ because it builds from both halves (datasets of
training/, the distributor of dataflow/), which training/ itself may not import."""

from __future__ import annotations

import json
import os
from itertools import islice
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
)

from tokenmill.dataflow.distributors import MapDistributor, MixtureDistributor
from tokenmill.preprocess.config import ConfigError, format_errors
from tokenmill.shards.schema import token_count
from tokenmill.storage.source import through_cache
from tokenmill.training.dataset_factory import DatasetFactory

__all__ = ["Recipe", "RecipeSource", "MixtureRecipe", "load_recipe", "realised_mix"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RecipeSource(_Strict):
    """One preprocessed dataset of the mix."""

    path: str = Field(description="dataset folder (relative to the recipe file) or URL")
    weight: PositiveFloat = Field(description="its share: weight / sum of weights")
    repeats: PositiveInt | None = Field(
        1, description="passes over it the mix may take, each a fresh order; null: unlimited"
    )
    name: str | None = Field(None, description="what reports and refusals call it (default: path)")


class MixtureRecipe(_Strict):
    """How the sources mix."""

    by: Literal["samples", "tokens"] = Field(
        "samples", description="weights count samples, or trained tokens"
    )
    on_exhausted: Literal["stop", "reweight"] = Field(
        "stop",
        description="a source out of passes ends the mix (stop), or leaves it and the rest "
        "keep their relative weights until all are spent (reweight)",
    )
    sources: list[RecipeSource] = Field(min_length=1, description="the datasets mixed")


class Recipe(_Strict):
    """A training mix: the datasets, how each is loaded (all alike), and how they mix."""

    train_type: Literal["seq", "sft", "dpo", "kto", "grpo"] = Field(
        description="how each source is loaded (DatasetFactory.load)"
    )
    window_size: PositiveInt = Field(description="tokens per window (DatasetFactory.load)")
    stride: PositiveInt | None = Field(None, description="window stride; null: window_size")
    max_len: PositiveInt = Field(2048, description="longest item (DatasetFactory.load)")
    sample: Literal["row", "record", "window"] | None = Field(
        None, description="sft only: what one sample is (DatasetFactory.load)"
    )
    seed: int = Field(42, description="seed of every source's order")
    shuffle: bool = Field(True, description="shuffle each source (per pass)")
    mixture: MixtureRecipe
    _base: str = PrivateAttr(".")  # the recipe file's folder: relative paths start there

    @classmethod
    def from_dict(cls, data: Any, origin: str = "recipe", base: str | Path = ".") -> Recipe:
        """A recipe from parsed YAML/JSON; errors name the dotted field and `origin`."""
        try:
            recipe = cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(format_errors(err, origin)) from None
        recipe._base = str(base)
        return recipe

    @property
    def base(self) -> str:
        """The folder relative source paths start from (the recipe file's)."""
        return self._base

    def paths(self) -> list[str]:
        """Each source's path; a relative one from the recipe's folder (lexically, so that a
        recipe reached through a link reads the datasets beside the link)."""
        return [
            s.path
            if through_cache(s.path) or os.path.isabs(s.path)
            else os.path.normpath(os.path.join(self._base, s.path))
            for s in self.mixture.sources
        ]

    def distributor(self, **load_options: Any) -> MixtureDistributor:
        """The MixtureDistributor of this recipe: each source loaded with DatasetFactory.load
        (`load_options`: its other keywords, such as integrity or cache_dir) and ordered by a
        MapDistributor whose epochs are the source's passes."""
        mix = self.mixture
        sources = [
            MapDistributor(
                DatasetFactory.load(
                    self.train_type,
                    path,
                    window_size=self.window_size,
                    stride=self.stride,
                    max_len=self.max_len,
                    sample=self.sample,
                    **load_options,
                ),
                seed=self.seed,
                shuffle=self.shuffle,
            )
            for path in self.paths()
        ]
        return MixtureDistributor(
            sources,
            [s.weight for s in mix.sources],
            by=mix.by,
            repeats=[s.repeats for s in mix.sources],
            on_exhausted=mix.on_exhausted,
            names=[s.name or s.path for s in mix.sources],
        )


def load_recipe(path: str | Path) -> Recipe:
    """The recipe of a YAML (or .json) file; relative source paths start from its folder."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.') or 'YAML'}: {err}") from None
    return Recipe.from_dict(data, origin=str(path), base=path.parent)


def _endless(mixture: MixtureDistributor) -> bool:
    """Whether the mixture never ends: stop needs one source that ends, reweight all."""
    ends = [not (isinstance(s, MapDistributor) and s.num_epochs is None) for s in mixture.sources]
    return not any(ends) if mixture.on_exhausted == "stop" else not all(ends)


def realised_mix(mixture: MixtureDistributor, samples: int | None = None) -> dict[str, Any]:
    """What `mixture` gives from its position on, to its end (or `samples` samples), as rank
    0 of 1 (a rank's own state: that rank): per source its samples, tokens, declared and
    realised share (in the mix's unit) and passes (samples over its size). It runs the
    mixture's own picks, so it is exact; by samples it reads no data (tokens are the stored
    lengths, None where a source has none), by tokens it reads each item, as training does.
    The mixture's state is restored after."""
    if samples is None and _endless(mixture):
        raise ValueError(
            "the mixture never ends (unlimited repeats): give samples= to see a prefix of it"
        )
    saved = mixture.state_dict()
    rank, world = mixture.coordinates or (0, 1)
    n = len(mixture.sources)
    taken, tokens = [0] * n, [0] * n
    measured = [mixture.by == "tokens" or s.sized for s in mixture.sources]  # tokens known
    start = list(mixture.counts)
    try:
        for index in islice(mixture.indices(rank, world), samples):
            i = index[0]
            taken[i] += 1
            if len(index) == 3:  # by tokens: the item read to count it
                tokens[i] += token_count(index[2])
            elif measured[i]:
                tokens[i] += mixture.sources[i].sample_length(index[1])
        counted = [now - before for now, before in zip(mixture.counts, start)]
    finally:
        mixture.load_state_dict(saved)
    weight, total = sum(mixture.weights), sum(counted) or 1
    rows = []
    for i, source in enumerate(mixture.sources):
        size = len(source.dataset) if isinstance(source, MapDistributor) else None
        rows.append(
            {
                "source": mixture.names[i],
                "weight": mixture.weights[i],
                "repeats": None if mixture.repeats is None else mixture.repeats[i],
                "declared": mixture.weights[i] / weight,
                "realised": counted[i] / total,
                "samples": taken[i],
                "tokens": tokens[i] if measured[i] else None,
                "passes": None if size is None else taken[i] * world / size,
            }
        )
    return {
        "by": mixture.by,
        "on_exhausted": mixture.on_exhausted,
        "samples": sum(taken),
        "tokens": sum(tokens) if all(measured) else None,
        "sources": rows,
    }

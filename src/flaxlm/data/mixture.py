"""Several corpora in one run (`language=[is,no,da]`): each source's share of the training
blocks, which source each row of a batch comes from, and the text the shared tokenizer learns.

Weights. Explicit (`mixture.weights`, normalised), or ∝ sizeᵀ (`mixture.temperature`: 1 by
size, 0 equal, 0.3 the multilingual default), a source's size being its training text in UTF-8
bytes: known before a tokenizer exists, and the unit bits per byte is counted in. A streamed
source has no known size, so it needs explicit weights (or temperature 0). `mixture.stages`
change the weights from given steps on.

Rows. Each row of each global batch is one whole block of one source: blocks never mix two
sources (within a source, documents are packed across block boundaries as in a single-language
run, and task.document_masking keeps each document to itself inside a block as there). Which
source a row comes from is decided row after row, globally and without randomness: the source
furthest behind its weight's share of the rows drawn so far in this stage (`MixtureSchedule`).
Every source's count then stays within one row of its weight × rows at all times, so shares
match the weights at any length of run, and the same seed gives the same blocks on any number
of processes. The randomness is inside each source: a packed source is read in a seeded shuffle
of its own blocks, a new one for each of its own epochs; a streamed one a window at a time
(data/streaming.py). A source that runs out starts its next epoch (or pass) on its own, while
the others go on: the run's length is the trainer's, not any source's.

Tokenizer. One byte-level BPE for every source, trained on a sample drawn with the weights: the
largest sample whose sources' shares of its bytes are their weights without repeating a
document (`tokenizer_sample`), so a small language gets its share of the vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from flaxlm.config import CorpusSource, LanguageConfig, MixtureConfig
from flaxlm.errors import FlaxlmError
from flaxlm.lazy_imports import lazy_module

datasets = lazy_module("datasets")
pc = lazy_module("pyarrow.compute")


def check_mixture_settings(mixture: MixtureConfig | None) -> None:
    """What can be checked before any text is read: sources, temperature, weights, stages."""
    if mixture is None or not mixture.sources:
        raise FlaxlmError(
            "language=mixture needs sources and mixture.sources is empty. Name the languages "
            "as a list, e.g. flaxlm-train 'language=[is,no,da]', or pick a mixture preset such "
            "as language=nordic."
        )
    for name, source in mixture.sources.items():
        if source.source == CorpusSource.mixture:
            raise FlaxlmError(f"mixture.sources.{name} is itself a mixture "
                              f"(language={source.name}); list its languages instead.")
    temperature = mixture.temperature
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise FlaxlmError(f"mixture.temperature={temperature} must be a finite number, 0 or "
                          "more: 1 weighs the sources by size, 0 equally, 0.3 in between.")
    names = list(mixture.sources)
    if mixture.weights is not None:
        normalised(mixture.weights, names, "mixture.weights")
    elif temperature != 0:
        streamed = [name for name, source in mixture.sources.items() if source.streaming]
        if streamed:
            raise FlaxlmError(
                f"mixture.temperature={temperature} weighs the sources by size, and the "
                f"streamed source(s) {', '.join(streamed)} have no known size. Give "
                "mixture.weights (e.g. mixture.weights={" + ", ".join(
                    f"{name}: 1" for name in names) + "}), or mixture.temperature=0 (equal).")
    previous = 0
    for index, stage in enumerate(mixture.stages):
        key = f"mixture.stages[{index}]"
        if not (isinstance(stage.start_step, int) and stage.start_step > previous):
            raise FlaxlmError(f"{key}.start_step={stage.start_step} must be a step after "
                              f"{'the start' if index == 0 else 'the previous stage'}'s "
                              f"({previous}): stages start at increasing steps, from 1 on.")
        normalised(stage.weights, names, f"{key}.weights")
        previous = stage.start_step


def normalised(weights, names: Sequence[str], key: str) -> np.ndarray:
    """Explicit weights (`key`: where they were given) for the sources `names`, in that order,
    divided by their sum; a FlaxlmError naming the key for anything else."""
    if not isinstance(weights, Mapping):
        raise FlaxlmError(f"{key}={weights!r} must map each language of the mixture to a weight, "
                          "e.g. {" + ", ".join(f"{name}: 1" for name in names) + "}.")
    unknown = [str(name) for name in weights if name not in names]
    if unknown:
        raise FlaxlmError(f"{key}.{unknown[0]} weighs a language that is not in the mixture "
                          f"({', '.join(names)}). Weigh only its languages, or add it to the "
                          "language list.")
    missing = [name for name in names if name not in weights]
    if missing:
        raise FlaxlmError(f"{key} gives no weight to {', '.join(missing)}: weigh every language "
                          "of the mixture (0 leaves one out of training but in evaluation).")
    values = []
    for name in names:
        value = weights[name]
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value < 0):
            raise FlaxlmError(f"{key}.{name}={value!r} must be a finite number, 0 or more.")
        values.append(float(value))
    total = sum(values)
    if total <= 0:
        raise FlaxlmError(f"{key} are all zero: at least one language needs a positive weight.")
    return np.asarray(values, np.float64) / total


def mixture_weights(mixture: MixtureConfig, sizes: Mapping[str, int]) -> dict[str, float]:
    """The weights the run trains with before any stage: mixture.weights normalised, or each
    source's size (`sizes`, in bytes) to the power of mixture.temperature, normalised."""
    names = list(mixture.sources)
    if mixture.weights is not None:
        weights = normalised(mixture.weights, names, "mixture.weights")
    else:
        powered = np.asarray([float(sizes[name]) ** mixture.temperature for name in names])
        weights = powered / powered.sum()
    return {name: float(weight) for name, weight in zip(names, weights)}


def stage_weights(mixture: MixtureConfig, weights: Mapping[str, float]) -> list[dict[str, float]]:
    """Each stage's weights, normalised, in the order of mixture.stages."""
    names = list(mixture.sources)
    return [dict(zip(names, map(float, normalised(stage.weights, names,
                                                  f"mixture.stages[{index}].weights"))))
            for index, stage in enumerate(mixture.stages)]


def describe_weights(weights: Mapping[str, float]) -> str:
    """'is 41.2%, no 58.8%'."""
    return ", ".join(f"{name} {weight:.1%}" for name, weight in weights.items())


# --- which source gives each row -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SchedulePosition:
    """Where the schedule stands after a batch: integers only, so a checkpoint holds it exactly."""

    steps: int = 0  # global batches drawn
    stage: int = 0  # the stage of the last one (0: before mixture.stages' first)
    stage_counts: tuple[int, ...] = ()  # rows drawn from each source in that stage
    taken: tuple[int, ...] = ()  # rows drawn from each source since the start, all processes

    def to_json(self) -> dict:
        return {"steps": self.steps, "stage": self.stage,
                "stage_counts": list(self.stage_counts), "taken": list(self.taken)}

    @classmethod
    def from_json(cls, saved: dict) -> SchedulePosition:
        return cls(saved["steps"], saved["stage"], tuple(saved["stage_counts"]),
                   tuple(saved["taken"]))


@dataclasses.dataclass(frozen=True)
class MixtureSchedule:
    """Which source gives each row of each global batch, and which of its rows (counted over
    its epochs): the source whose count lags its weight's share of the stage's rows most."""

    weights: tuple[np.ndarray, ...]  # per stage (the first: before any stage), by source index
    stage_starts: tuple[int, ...]  # the first step of each stage (the first stage's: 0)

    @classmethod
    def of(cls, names: Sequence[str], weights: Mapping[str, float],
           stages: Iterable[tuple[int, Mapping[str, float]]] = ()) -> MixtureSchedule:
        starts, vectors = [0], [np.asarray([weights[name] for name in names], np.float64)]
        for start, stage in stages:
            starts.append(start)
            vectors.append(np.asarray([stage[name] for name in names], np.float64))
        return cls(tuple(vectors), tuple(starts))

    def start(self) -> SchedulePosition:
        zeros = (0,) * len(self.weights[0])
        return SchedulePosition(0, 0, zeros, zeros)

    def draw(self, position: SchedulePosition,
             rows: int) -> tuple[np.ndarray, np.ndarray, SchedulePosition]:
        """The next global batch of `rows` rows: each row's source index and that source's row
        number (its `taken` count before the row), and the position after the batch."""
        # The batch of step `steps + 1` (the loop counts steps from 1): a stage's own first.
        stage = int(np.searchsorted(self.stage_starts, position.steps + 1, side="right")) - 1
        weights = self.weights[stage]
        counts = np.asarray(position.stage_counts if stage == position.stage
                            else (0,) * len(weights), np.int64)
        taken = np.asarray(position.taken, np.int64)
        drawn = int(counts.sum())
        sources, numbers = np.empty(rows, np.int64), np.empty(rows, np.int64)
        for row in range(rows):
            source = int(np.argmax(weights * (drawn + row + 1) - counts))
            sources[row], numbers[row] = source, taken[source]
            counts[source] += 1
            taken[source] += 1
        after = SchedulePosition(position.steps + 1, stage, tuple(map(int, counts)),
                                 tuple(map(int, taken)))
        return sources, numbers, after


# --- the tokenizer's text ------------------------------------------------------------------------


def text_bytes(texts: datasets.Dataset) -> np.ndarray:
    """Each document's length in UTF-8 bytes."""
    lengths = pc.binary_length(texts.with_format("arrow")["text"])
    return lengths.to_numpy(zero_copy_only=False).astype(np.int64)


def tokenizer_sample(texts: Mapping[str, datasets.Dataset],
                     weights: Mapping[str, float]) -> datasets.Dataset:
    """The documents a shared tokenizer trains on: from each source its first documents, as
    many as make its weight's share of the sample's bytes, the sample as large as the sources
    allow without repeating a document. `texts`: each source's training documents (a streamed
    source's first tokenizer.train_docs)."""
    sizes = {name: np.cumsum(text_bytes(docs)) for name, docs in texts.items()}
    weighted = [name for name in texts if weights[name] > 0]
    budget = min(sizes[name][-1] / weights[name] for name in weighted)
    # Each source's documents up to its share, the one that crosses it included.
    parts = [texts[name].select(range(min(len(texts[name]), int(np.searchsorted(
        sizes[name], weights[name] * budget * (1 - 1e-9))) + 1))) for name in weighted]
    return datasets.concatenate_datasets(parts)


def source_error(name: str, language: LanguageConfig, err: FlaxlmError) -> FlaxlmError:
    """A source's own error, saying which source of the mixture it is about."""
    return type(err)(f"mixture.sources.{name} (language {language.name}): {err}")

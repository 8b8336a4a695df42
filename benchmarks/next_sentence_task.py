"""An offline multiple-choice task for lm-evaluation-harness, built from the builtin corpus's
validation documents: three lines of a document, then which of four lines comes next (the
true one, or a line of another document; chance is 25%).

    python benchmarks/next_sentence_task.py DIR [--examples 500] [--seed 0]
    flaxlm-eval outputs/clm/runs/<time> --tasks next_line --include-path DIR

Writes DIR/next_line.jsonl (the examples) and DIR/next_line.yaml (the task, pointing at them).
The validation documents are those a flaxlm-train run of the default language holds out, so
a model trained on the builtin corpus has not seen them.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

CONTEXT_LINES, CHOICES = 3, 4
TASK = """\
task: next_line
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
validation_split: validation
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def documents_lines() -> list[list[str]]:
    """The builtin corpus's validation documents (as flaxlm-train splits them), as lines
    long enough to tell apart."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from flaxlm.config import register_configs
    from flaxlm.data.corpus import load_corpus

    register_configs()
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(conf, version_base="1.3"):
        config = OmegaConf.to_object(compose("train", overrides=["run_dir=unset"]))
    validation = load_corpus(config.language).validation
    return [[line.strip() for line in text.splitlines() if len(line.strip()) >= 20]
            for text in validation["text"]]


def examples(docs: list[list[str]], count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    usable = [i for i, lines in enumerate(docs) if len(lines) > CONTEXT_LINES]
    rows = []
    while len(rows) < count:
        doc = int(rng.choice(usable))
        start = int(rng.integers(len(docs[doc]) - CONTEXT_LINES))
        context = docs[doc][start:start + CONTEXT_LINES]
        truth = docs[doc][start + CONTEXT_LINES]
        others = [d for d in rng.choice(usable, CHOICES - 1, replace=False) if d != doc]
        if len(others) < CHOICES - 1:
            continue
        choices = [docs[d][int(rng.integers(len(docs[d])))] for d in others]
        label = int(rng.integers(CHOICES))
        choices.insert(label, truth)
        rows.append({"context": "\n".join(context) + "\n", "choices": choices, "label": label})
    return rows


def write_task(folder: str, count: int = 500, seed: int = 0) -> str:
    """The task's data and YAML in `folder`; returns the YAML's path."""
    os.makedirs(folder, exist_ok=True)
    data = os.path.abspath(os.path.join(folder, "next_line.jsonl"))
    with open(data, "w", encoding="utf-8") as f:
        for row in examples(documents_lines(), count, seed):
            f.write(json.dumps(row) + "\n")
    path = os.path.join(folder, "next_line.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(TASK.format(data=data))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", metavar="DIR")
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_task(args.folder, args.examples, args.seed))


if __name__ == "__main__":
    main()

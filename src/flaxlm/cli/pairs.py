"""`flaxlm-pairs OUT_DIR`: a sentence-pair dataset laid out like GLUE MRPC, made offline from the
built-in corpus (see flaxlm.data.pairs), for fine-tuning without the Hub.

    flaxlm-pairs pairs/     # pairs/train.tsv, pairs/validation.tsv
"""

from __future__ import annotations

from collections.abc import Sequence

from flaxlm.cli.common import Parser, run_command
from flaxlm.data.pairs import TRAIN_ROWS, VALIDATION_ROWS, write_pair_dataset
from flaxlm.errors import writable_dir


def parser() -> Parser:
    parse = Parser("flaxlm-pairs", __doc__.split("\n\n")[0])
    parse.add_argument("out_dir", metavar="OUT_DIR",
                       help="the folder to write train.tsv and validation.tsv into")
    parse.add_argument("--train", type=int, default=TRAIN_ROWS, metavar="N",
                       help="training pairs (MRPC's count)")
    parse.add_argument("--validation", type=int, default=VALIDATION_ROWS, metavar="N",
                       help="validation pairs (MRPC's count)")
    parse.add_argument("--seed", type=int, default=0, help="the seed that picks the pairs")
    return parse


def run(argv: Sequence[str]) -> list[str]:
    """Write the dataset as the command line says; returns the paths of its files."""
    args = parser().parse_args(argv)
    out_dir = writable_dir(args.out_dir, "OUT_DIR", "Choose a folder you can write to.")
    paths = write_pair_dataset(out_dir, args.train, args.validation, args.seed)
    for path, count in zip(paths, (args.validation, args.train)):
        print(f"flaxlm: wrote {count} pairs to {path}")
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()

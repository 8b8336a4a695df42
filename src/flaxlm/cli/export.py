"""`flaxlm-export RUN_DIR --out DIR`: a run's checkpoint (the latest, or `--step`) as a Hugging
Face model directory, with the run's tokenizer, a generation config and a model card.

    flaxlm-export outputs/clm/runs/<time> --out my-model
    flaxlm-export outputs/clm/runs/<time> --out my-model --step 200
    flaxlm-export outputs/clm/runs/<time> --out gs://bucket/models/my-model

An --out in a bucket (gs://, s3://) is written locally first, then uploaded with its marker
(flaxlm_export.json) last: a folder without it is an export cut short.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

from flaxlm.cli.common import Parser, add_run_dir, add_step, run_command


def parser() -> Parser:
    parse = Parser("flaxlm-export", __doc__.split("\n\n")[0])
    add_run_dir(parse, "to export")
    parse.add_argument("--out", required=True, metavar="DIR",
                       help="the Hugging Face directory to write (required), or a bucket "
                            "folder (gs://, s3://); an existing one "
                            "is replaced only if it is an earlier flaxlm export, never if it "
                            "holds or contains a run")
    add_step(parse)
    parse.add_argument("--overwrite", action="store_true",
                       help="also replace a run's own model/ folder that holds only the "
                            "tokenizer and config written when the run started")
    return parse


def run(argv: Sequence[str]) -> str:
    """Export as the command line says; returns the output directory (or bucket folder)."""
    args = parser().parse_args(argv)
    from flaxlm.export import (
        MARKER,
        check_bucket_destination,
        check_destination,
        eval_metrics_at,
        export_hf,
        run_generation_settings,
    )
    from flaxlm.run_model import bucket_run_copy, load_run_model, local_mesh
    from flaxlm.storage import is_url, upload_folder

    in_bucket = is_url(args.out)
    # Checked before reading: a bucket folder is written here first, then uploaded.
    if in_bucket:
        check_bucket_destination(args.out)
    else:
        check_destination(args.out, args.overwrite, args.run_dir)
    run_model = load_run_model(args.run_dir, args.step, local_mesh())  # split over devices
    metrics = eval_metrics_at(bucket_run_copy(args.run_dir) if is_url(args.run_dir)
                              else args.run_dir, run_model.step)
    staging = tempfile.mkdtemp(prefix="flaxlm-export-") if in_bucket else None
    try:
        out = export_hf(
            os.path.join(staging, "model") if in_bucket else args.out,
            run_model.params, run_model.model_config, run_model.tokenizer,
            run_config=run_model.run_config, eval_metrics=metrics,
            hf_config=run_model.hf_config,  # a classifier's; None → the LM's GPT2Config
            generation=(None if run_model.hf_config is not None
                        else run_generation_settings(run_model.run_config)),
            source=run_model.source, overwrite=args.overwrite, run_dir=args.run_dir,
            own_conventions=run_model.own_conventions,
        )
        if in_bucket:
            upload_folder(out, args.out, "--out", MARKER)
            out = args.out
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    print(f"flaxlm: exported {run_model.source} to {out}")
    return out


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()

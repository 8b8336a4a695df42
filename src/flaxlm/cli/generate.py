"""`flaxlm-generate run_dir=… prompt="…"`: complete prompts with a run's model (its latest
checkpoint, or `step`; a run without checkpoints uses the model it exported at its end).

    flaxlm-generate run_dir=outputs/clm/runs/<timestamp> prompt="Return the"
    flaxlm-generate run_dir=… prompt="The list" prompt="A dict" temperature=0.7 top_k=40
    flaxlm-generate run_dir=… 'prompt=[The list, A dict]' greedy=true max_new_tokens=100

Settings are `key=value`, as with flaxlm-train; a mistake is one paragraph on stderr and exit
status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from flaxlm.cli.export import Setting, boolean, optional_int, parse_settings, run_command

USAGE = """usage: flaxlm-generate run_dir=DIR [prompt=TEXT ...] [step=N] [max_new_tokens=N]
                       [temperature=T] [top_k=K] [top_p=P] [seed=S] [greedy=true]

  run_dir         a flaxlm-train run directory (outputs/clm/runs/<timestamp>)
  prompt          text to complete; repeat it, or prompt=[a,b], for several (default: one
                  empty prompt, i.e. a document of the model's own)
  step            the checkpoint to use (default: the latest complete one)
  max_new_tokens  tokens to add at most; a row also stops at the end-of-text token (default 50)
  temperature     softmax temperature; 0 means greedy (default 1.0)
  top_k           sample from the k most likely tokens; 0: all (default 50)
  top_p           ... and from the fewest whose probability reaches p; 1: all (default 1.0)
  seed            sampling seed (default 0)
  greedy          always take the most likely token (default false)"""

SETTINGS = {
    "run_dir": Setting(str, required=True),
    "prompt": Setting(str, default=[""], repeated=True),
    "step": Setting(optional_int),
    "max_new_tokens": Setting(int, default=50),
    "temperature": Setting(float, default=1.0),
    "top_k": Setting(int, default=50),
    "top_p": Setting(float, default=1.0),
    "seed": Setting(int, default=0),
    "greedy": Setting(boolean, default=False),
}


def run(argv: Sequence[str]) -> list[str]:
    """Generate as the command line says, print each prompt with its completion, return the
    completions."""
    args = parse_settings(argv, SETTINGS, "flaxlm-generate", USAGE)
    from flaxlm.export import load_run_model
    from flaxlm.generate import GenerationSettings, generate

    settings = GenerationSettings(
        max_new_tokens=args["max_new_tokens"], greedy=args["greedy"],
        temperature=args["temperature"], top_k=args["top_k"], top_p=args["top_p"],
        seed=args["seed"],
    )
    run_model = load_run_model(args["run_dir"], args["step"])
    print(f"flaxlm: generating with {run_model.source}", file=sys.stderr)
    completions = generate(run_model.model(), run_model.tokenizer, args["prompt"], settings,
                           own_conventions=run_model.own_conventions)
    print("\n---\n".join(p + c for p, c in zip(args["prompt"], completions)))
    return completions


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()

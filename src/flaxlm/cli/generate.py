"""`flaxlm-generate RUN_DIR --prompt TEXT`: complete prompts with a run's model (its latest
checkpoint, or `--step`; a run without checkpoints uses the model it exported at its end).

    flaxlm-generate outputs/clm/runs/<time> --prompt "Return the"
    flaxlm-generate outputs/clm/runs/<time> --prompt "The list" --prompt "A dict" --top-k 40
    flaxlm-generate outputs/clm/runs/<time> --prompt "The list" --greedy --max-new-tokens 100
    flaxlm-generate outputs/sft/runs/<time> --chat --prompt "What is 2 + 5?" --greedy

Prints each prompt with its completion, separated by `---` lines; with --chat, each prompt is a
user's turn in the run's chat template and the completion the model's reply (up to its end of
turn), as transformers' apply_chat_template(..., add_generation_prompt=True) + generate give.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from flaxlm.cli.common import Parser, add_run_dir, add_step, run_command


def parser() -> Parser:
    from flaxlm.tool_defaults import GenerationSettings  # the defaults' one home, without JAX

    defaults = GenerationSettings()
    parse = Parser("flaxlm-generate", __doc__.split("\n\n")[0],
                   epilog=__doc__.split("\n\n", 1)[1])
    add_run_dir(parse, "whose model generates")
    parse.add_argument("--prompt", action="append", metavar="TEXT",
                       help="text to complete; repeat it for several (default: one empty "
                            "prompt, i.e. a document of the model's own)")
    add_step(parse)
    parse.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens,
                       metavar="N", help="tokens to add at most; a row also stops at the "
                                         "end-of-text token")
    parse.add_argument("--temperature", type=float, default=defaults.temperature, metavar="T",
                       help="softmax temperature; 0 means greedy")
    parse.add_argument("--top-k", type=int, default=defaults.top_k, metavar="K",
                       help="sample from the K most likely tokens; 0: all")
    parse.add_argument("--top-p", type=float, default=defaults.top_p, metavar="P",
                       help="... and from the fewest whose probability reaches P; 1: all")
    parse.add_argument("--seed", type=int, default=defaults.seed, help="sampling seed")
    parse.add_argument("--greedy", action="store_true", default=defaults.greedy,
                       help="always take the most likely token (no sampling)")
    parse.add_argument("--chat", action="store_true",
                       help="answer each prompt as a user's turn, in the tokenizer's chat "
                            "template (a task=sft run's model)")
    return parse


def run(argv: Sequence[str]) -> list[str]:
    """Generate as the command line says, print each prompt with its completion, return the
    completions."""
    args = parser().parse_args(argv)
    from flaxlm.errors import FlaxlmError
    from flaxlm.generate import GenerationSettings, generate, generate_chat
    from flaxlm.run_model import load_run_model, local_mesh

    prompts = args.prompt or [""]
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens, greedy=args.greedy, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed,
    )
    run_model = load_run_model(args.run_dir, args.step, local_mesh())  # split over devices
    print(f"flaxlm: generating with {run_model.source}", file=sys.stderr)
    if args.chat and not run_model.tokenizer.chat_template:
        raise FlaxlmError(
            f"--chat: the tokenizer of {args.run_dir} has no chat template (a task=clm run's "
            "model has none). Drop --chat to complete the prompts as text, or pass a task=sft "
            "run.")
    if args.chat:
        completions = generate_chat(run_model.model(), run_model.tokenizer, prompts, settings)
        print("\n---\n".join(f"user: {p}\nassistant: {c}" for p, c in zip(prompts, completions)))
        return completions
    completions = generate(run_model.model(), run_model.tokenizer, prompts, settings,
                           own_conventions=run_model.own_conventions)
    print("\n---\n".join(p + c for p, c in zip(prompts, completions)))
    return completions


def main(argv: Sequence[str] | None = None) -> None:
    run_command(run, argv)


if __name__ == "__main__":
    main()

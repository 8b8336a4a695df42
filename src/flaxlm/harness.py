"""EleutherAI's lm-evaluation-harness on flaxlm models, with no conversion to PyTorch.

`FlaxlmLM` is the harness's model interface (`loglikelihood`, `loglikelihood_rolling`,
`generate_until`) over a flaxlm language model, registered with the harness as `flaxlm`:

    import flaxlm.harness, lm_eval
    lm_eval.simple_evaluate(model="flaxlm", model_args="run_dir=outputs/clm/runs/<time>",
                            tasks=["hellaswag"])

Token boundaries are the harness's own (`TemplateLM`: a context's trailing spaces move to the
continuation, the pair is encoded whole and split where the context ends, an empty context is
the document-start token), read with the tokenizer as the model read a document's start
(`prompt_tokenizer`): a flaxlm run's after its EOS, a run from someone's weights with their
BOS. So the scores are those of the harness's `hf` backend on the run's export. Log-likelihoods
go to `flaxlm.scoring` (each context once, its continuations as branches); generation to
`flaxlm.generate` (the KV cache), greedy unless a task samples.

Every process of a multi-host run computes every request (the rows are split over all
devices), so each holds the whole result; only process 0 writes files.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from jax.sharding import Mesh
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from flaxlm.data.tokenizer import prompt_tokenizer
from flaxlm.errors import FlaxlmError
from flaxlm.generate import GenerationSettings, LanguageModel, generate_ids
from flaxlm.scoring import DEFAULT_BATCH_ROWS, score

DEFAULT_MAX_GEN_TOKS = 256  # the harness's own default for generate_until tasks


@register_model("flaxlm")
class FlaxlmLM(TemplateLM):
    """A flaxlm language model as the harness's `LM`.

    From the command line's `--model_args`: `run_dir` (a flaxlm-train run: its latest
    checkpoint, or `step`, or the model it exported at its end) and `batch_size` (rows per
    forward pass). In code, `FlaxlmLM.of(model, tokenizer, ...)` wraps a model in memory (a
    run's evaluation during training)."""

    def __init__(self, run_dir: str | None = None, step: int | str | None = None,
                 batch_size: int | str | None = DEFAULT_BATCH_ROWS,
                 max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS, **_ignored):
        super().__init__()
        if run_dir is None:
            raise FlaxlmError(
                "The flaxlm model needs the run to evaluate: --model_args "
                "run_dir=outputs/clm/runs/<time> (and optionally step=N)."
            )
        from flaxlm.run_model import load_run_model, local_mesh

        mesh = local_mesh()
        run_model = load_run_model(str(run_dir), None if step in (None, "") else int(step), mesh)
        self._setup(run_model.model(), run_model.tokenizer, run_model.own_conventions, mesh,
                    batch_size, max_gen_toks)
        self.source, self.step = run_model.source, run_model.step

    @classmethod
    def of(cls, model: LanguageModel, tokenizer, *, own_conventions: bool,
           mesh: Mesh | None = None, batch_size: int = DEFAULT_BATCH_ROWS,
           max_gen_toks: int = DEFAULT_MAX_GEN_TOKS) -> FlaxlmLM:
        lm = cls.__new__(cls)
        TemplateLM.__init__(lm)
        lm._setup(model, tokenizer, own_conventions, mesh, batch_size, max_gen_toks)
        lm.source, lm.step = "the model in training", None
        return lm

    def _setup(self, model, tokenizer, own_conventions, mesh, batch_size, max_gen_toks):
        self.model, self.mesh = model, mesh
        # Encoding adds what the model saw at a document's start (`prompt_tokenizer`).
        self.tokenizer = prompt_tokenizer(tokenizer, own_conventions)
        self.batch_size = (DEFAULT_BATCH_ROWS if batch_size in (None, "", "auto")
                           else int(str(batch_size).split(":")[0]))
        self.max_gen_toks = int(max_gen_toks)
        if self.batch_size < 1 or self.max_gen_toks < 1:
            raise FlaxlmError(
                f"batch_size={batch_size} and max_gen_toks={max_gen_toks} must be at least 1."
            )

    # ------------------------------------------------------------ tokens, as HF's backend

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: the BOS token, else EOS (a flaxlm document's start)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.model.context_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **_) -> list[int]:
        """`string`'s ids, read as a document's start unless `add_special_tokens` is False
        or the string already starts with the start token."""
        if add_special_tokens is None and string.startswith(
                self.tokenizer.decode([self.prefix_token_id])):
            add_special_tokens = False
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = self.tokenizer.encode(string, **kwargs)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------ the three requests

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_
                              ) -> list[tuple[float, bool]]:
        pairs = [(context, continuation) for _, context, continuation in requests]
        results = score(self.model, pairs, batch_rows=self.batch_size, mesh=self.mesh)
        for (key, _, _), result in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood, read in windows of the model's context as the harness
        cuts them, every token predicted once with as much of the text before it as fits."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, up to the first of the request's stop strings (and
        the end-of-text token), greedy unless the request samples. Requests with the same
        generation settings are batched, longest first; a context is cut from the left to
        leave room for the new tokens, as the harness's hf backend does."""
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(requests[indices[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            settings = _generation_settings(kwargs, self.max_length)
            room = self.max_length - settings.max_new_tokens
            encoded = {i: self.tok_encode(requests[i].args[0], left_truncate_len=room)
                       for i in indices}
            ordered = sorted(indices, key=lambda i: -len(encoded[i]))
            for first in range(0, len(ordered), self.batch_size):
                batch = ordered[first:first + self.batch_size]
                new_ids = generate_ids(self.model, [encoded[i] for i in batch], settings,
                                       eos_token_id=self.eot_token_id,
                                       pad_token_id=self.tokenizer.pad_token_id)
                for i, ids in zip(batch, new_ids):
                    text = postprocess_generated_text(self.tok_decode(ids), until, None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")


def _generation_settings(kwargs: dict, max_length: int) -> GenerationSettings:
    """A request's generation settings (the harness's normalised kwargs) as ours: greedy
    unless it samples; transformers' defaults for what it leaves out."""
    max_new_tokens = int(kwargs.pop("max_gen_toks"))
    if max_new_tokens >= max_length:
        raise FlaxlmError(
            f"A generate_until task asks for up to {max_new_tokens} new tokens, which leaves "
            f"no room for its prompt in the model's context of {max_length} positions. Lower "
            "max_gen_toks (--gen-kwargs max_gen_toks=N, or the task's generation_kwargs)."
        )
    sampling = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature") or 0) > 0
    return GenerationSettings(
        max_new_tokens=max_new_tokens, greedy=not sampling,
        temperature=float(kwargs.get("temperature") or 1.0) if sampling else 1.0,
        top_k=int(kwargs.get("top_k") or 50), top_p=float(kwargs.get("top_p") or 1.0),
        seed=int(kwargs.get("seed") or 0),
    )


@dataclasses.dataclass(frozen=True)
class HarnessResults:
    """What one evaluation of harness tasks gave: the harness's own results (its JSON) and
    the metrics flaxlm logs, `eval/<task>/<metric>`."""

    raw: dict
    metrics: dict[str, float]
    table: str


@functools.cache
def task_index(include_path: str | None):
    """The harness's index of its tasks and those under `include_path`, built once per folder:
    building it reads every task file the harness ships (seconds), and a run that evaluates
    every N steps would otherwise pay that at each evaluation."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path)


def evaluate(lm: FlaxlmLM, tasks: Sequence[str], *, limit: int | float | None = None,
             num_fewshot: int | None = None, include_path: str | None = None,
             seed: int = 0) -> HarnessResults:
    """Run harness `tasks` (names, groups, or tasks defined by YAML files under
    `include_path`) on `lm`; `limit`: examples per task (a fraction below 1)."""
    import lm_eval
    from lm_eval.utils import make_table

    manager = task_index(include_path)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise FlaxlmError(
            f"Unknown lm-evaluation-harness task(s): {', '.join(unknown)}. Give names the "
            "harness lists (`lm_eval ls tasks`), or a task of your own as a YAML file in a "
            "folder passed as --include-path (docs/evaluating.md, \"Tasks on local data\")."
        )
    try:
        raw = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), limit=limit, num_fewshot=num_fewshot,
            task_manager=manager, random_seed=seed, numpy_random_seed=seed,
            torch_random_seed=seed, fewshot_random_seed=seed, log_samples=False,
            bootstrap_iters=1000)
    except (ConnectionError, OSError) as error:
        if isinstance(error, FlaxlmError):
            raise
        raise FlaxlmError(
            f"lm-evaluation-harness could not load the data of {', '.join(tasks)}: {error}. "
            "A task whose data is on the Hugging Face Hub needs the network (or the dataset "
            "already in the local cache); with neither, point the task at a local copy of its "
            "data (docs/evaluating.md, \"Tasks on local data\")."
        ) from None
    raw.pop("config", None)  # holds the model object; the run's own config says what it was
    return HarnessResults(raw, flat_metrics(raw["results"]), make_table(raw))


def flat_metrics(results: dict) -> dict[str, float]:
    """The harness's per-task results as `eval/<task>/<metric>`: the metric's name without
    its filter when the filter is the default (`acc,none` → acc), else `metric_filter`."""
    metrics = {}
    for task, values in results.items():
        for key, value in values.items():
            if "," not in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, filter_name = key.split(",", 1)
            name = metric if filter_name == "none" else f"{metric}_{filter_name}"
            metrics[f"eval/{task}/{name}"] = float(value)
    return metrics

"""The defaults of flaxlm-generate's and flaxlm-eval's options, importable without JAX: a tool's
`--help` shows them, and JAX (seconds to import, more on a TPU VM) is no part of printing a help
text. `flaxlm.generate` and `flaxlm.scoring` use them from here."""

from __future__ import annotations

import dataclasses

from flaxlm.errors import FlaxlmError

DEFAULT_BATCH_ROWS = 32  # rows per forward pass of scoring (flaxlm-eval --batch-size)


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """How to pick each new token. `greedy` (or temperature 0) takes the most likely token;
    otherwise logits / temperature are cut to the `top_k` most likely tokens (0: no cut) and
    then to the smallest set whose probability reaches `top_p` (1.0: no cut), and sampled."""

    max_new_tokens: int = 50
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 50  # as transformers' default
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise FlaxlmError(f"max_new_tokens={self.max_new_tokens} must be at least 1.")
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise FlaxlmError(
                f"temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}: "
                "temperature and top_k must be at least 0 (temperature 0: greedy; top_k 0: no "
                "cut) and top_p in (0, 1] (1: no cut)."
            )

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0

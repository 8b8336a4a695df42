"""Preference pairs generated in code (task.drills with task=dpo): offline data whose preferred
reply follows one plain rule, so that a tiny model shows on a CPU in minutes whether DPO
learns a preference.

The prompt is a few words from a small list; the chosen reply repeats its last word, the
rejected one is another word of the list (often one of the prompt's others). Words are common
English ones, so a BPE trained on the pairs makes each one token: repeating the last one is a
copy a small transformer picks up quickly.
"""

from __future__ import annotations

import random

WORDS = ("red", "blue", "green", "cat", "dog", "fox", "sun", "moon", "tree", "fish", "bird",
         "star")


def preference_drills(count: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """`count` (prompt, chosen, rejected) texts, the same ones for the same seed."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 4))]
        wrong = rng.choice([word for word in WORDS if word != words[-1]])
        pairs.append(("Repeat the last word: " + " ".join(words), words[-1], wrong))
    return pairs

"""Drill conversations generated in code (task.drills): offline chat data small enough that a
tiny model learns it on a CPU in minutes, with answers that are plainly right or wrong.

Two drills: single-digit sums ("What is 3 + 4?" → "3 + 4 = 7.") and reversing a few spaced
letters ("Reverse: c a t" → "t a c"). Letters are spaced so that each is one token: reversal
is then a token-level skill a small transformer picks up quickly. One conversation in three
has a second exchange, so the assistant turns to learn from are not always the last.
"""

from __future__ import annotations

import random

LETTERS = "abcdefghij"


def drill_exchange(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair."""
    if rng.random() < 0.5:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    letters = [rng.choice(LETTERS) for _ in range(rng.randint(2, 4))]
    return f"Reverse: {' '.join(letters)}", " ".join(reversed(letters))


def drill_conversations(count: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """`count` conversations, the same ones for the same seed."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(count):
        turns = []
        for _ in range(2 if rng.random() < 1 / 3 else 1):
            question, answer = drill_exchange(rng)
            turns += [{"role": "user", "content": question},
                      {"role": "assistant", "content": answer}]
        conversations.append(turns)
    return conversations


# Prompts the drills preset asks at the end of the run (samples.prompts): its answers say
# whether the model learnt the drills.
DRILL_PROMPTS = ("What is 2 + 5?", "What is 7 + 8?", "Reverse: a b c", "Reverse: d e f g")

"""What the voices say: random word sequences for training, and a closed set of held-out sentences for the oracle.

Training text is drawn from pocketsphinx's CMU dictionary (phonetic variety, not meaning); the held-out sentences
are written here, and a training draw is never one of them.
"""

from __future__ import annotations

import random
import re
from functools import cache
from pathlib import Path

HELDOUT_SENTENCES: list[str] = [
    "please open the kitchen window",
    "the train leaves at seven tonight",
    "my brother plays the violin",
    "turn left at the next corner",
    "we need more milk and bread",
    "the weather is cold and windy",
    "she painted the fence bright green",
    "how much does the ticket cost",
    "the dog is sleeping under the table",
    "call me when you get home",
    "the meeting starts in ten minutes",
    "i lost my keys in the garden",
    "this coffee tastes very bitter",
    "the children are playing outside",
    "put the books back on the shelf",
    "our flight was delayed by two hours",
    "he fixed the bicycle yesterday",
    "the river flows into the sea",
    "can you help me carry this box",
    "the museum is closed on monday",
    "she reads a newspaper every morning",
    "the soup needs a little more salt",
    "they built a house near the lake",
    "the light in the hallway is broken",
    "we watched a movie last weekend",
    "the baby laughed at the funny clown",
    "please write your name on the form",
    "the garden is full of yellow flowers",
    "my phone battery is almost empty",
    "the teacher asked a difficult question",
    "he runs five miles before breakfast",
    "the store sells fresh fish and fruit",
    "a strong wind blew the leaves away",
    "the doctor will see you now",
    "we planted three apple trees",
    "the old bridge needs new paint",
    "she forgot her umbrella on the bus",
    "the cat jumped over the wooden fence",
    "dinner will be ready at eight",
    "the library opens early on saturday",
]


@cache
def dictionary_words() -> list[str]:
    """Plain words (letters only, 2 to 10 of them) from pocketsphinx's CMU dictionary, sorted."""
    from pocketsphinx import get_model_path

    words = set()
    with open(Path(get_model_path()) / "en-us" / "cmudict-en-us.dict") as f:
        for line in f:
            word = line.split(" ", 1)[0]
            if re.fullmatch(r"[a-z]{2,10}", word):
                words.add(word)
    return sorted(words)


def training_sentences(count: int, seed: int, words: tuple[int, int] = (4, 12)) -> list[str]:
    """`count` sentences of `words[0]` to `words[1]` random dictionary words, none of them a held-out sentence."""
    rng = random.Random(seed)
    vocabulary = dictionary_words()
    held = set(HELDOUT_SENTENCES)
    out: list[str] = []
    while len(out) < count:
        sentence = " ".join(rng.choice(vocabulary) for _ in range(rng.randint(*words)))
        if sentence not in held:
            out.append(sentence)
    return out

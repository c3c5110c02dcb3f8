"""The fine-tuning demo's task: short generated sentences about one of four topics (animals, food, weather,
computers), to be classified by topic. Training and held-out sets come from different seeds, and the held-out one
uses sentence templates the training set never shows; every sentence ends with a topic word."""

from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS: dict[str, tuple[str, ...]] = {
    "animals": ("cat", "dog", "horse", "rabbit", "sheep", "goat", "fox", "owl", "mouse", "duck", "bear", "wolf"),
    "food": ("bread", "soup", "cheese", "apple", "rice", "pie", "salad", "butter", "honey", "pasta", "cake", "tea"),
    "weather": ("rain", "snow", "wind", "storm", "fog", "sun", "cloud", "thunder", "frost", "hail", "mist", "heat"),
    "computers": ("disk", "kernel", "screen", "printer", "cable", "server", "byte", "laptop", "chip", "modem", "file",
                  "code"),
}  # fmt: skip
LABELS = tuple(TOPICS)
# the topic words come last: a causal model's last position (where the head reads) has seen every word
TRAIN_TEMPLATES = (
    "I think the {0} is near the {1}",
    "There was a {0}, then a {1}",
    "We talked all day about the {1}",
    "My friend likes the {0} and the {1}",
    "Look over there at that {1}",
    "Nobody expected the {0} or the {1}",
)
HELD_OUT_TEMPLATES = (
    "Yesterday everybody was talking about the {1}",
    "She wrote a story about a {0} and a {1}",
    "Is it still here, the {1}",
)


@dataclass(frozen=True)
class Example:
    text: str
    label: int  # index into LABELS


def make_examples(count: int, *, seed: int, held_out: bool = False) -> list[Example]:
    """`count` sentences, topics balanced in turn, words and templates drawn with `seed` (every word names one
    topic, so a perfect classifier exists)."""
    rng = random.Random(seed)
    templates = HELD_OUT_TEMPLATES if held_out else TRAIN_TEMPLATES
    examples = []
    for i in range(count):
        label = i % len(LABELS)
        words = TOPICS[LABELS[label]]
        template = rng.choice(templates)
        examples.append(Example(template.format(*rng.sample(words, 2)), label))
    rng.shuffle(examples)
    return examples

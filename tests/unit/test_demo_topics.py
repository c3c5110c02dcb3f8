"""The fine-tuning demo's generated task: balanced labels, every word naming one topic, held-out sentences built
from templates the training set never uses, the same examples for the same seed."""

from __future__ import annotations

from collections import Counter

from corolla.demo.topics import HELD_OUT_TEMPLATES, LABELS, TOPICS, TRAIN_TEMPLATES, make_examples


def test_examples_are_balanced_reproducible_and_held_out_by_template():
    train = make_examples(100, seed=0)
    assert train == make_examples(100, seed=0) and train != make_examples(100, seed=1)
    assert Counter(e.label for e in train) == {label: 25 for label in range(len(LABELS))}
    words = [w for topic in TOPICS.values() for w in topic]
    assert len(words) == len(set(words))  # one topic per word: a perfect classifier exists
    for example in train:
        assert example.text.split()[-1] in TOPICS[LABELS[example.label]]  # the last word names the topic
    held_out = make_examples(40, seed=1, held_out=True)
    stems = {t.split("{")[0] for t in TRAIN_TEMPLATES}
    assert all(not any(e.text.startswith(s) for s in stems) for e in held_out)
    assert {t.split("{")[0] for t in HELD_OUT_TEMPLATES}.isdisjoint(stems)

"""Falcon family: the new decoder architecture (GQA, two parallel LayerNorms) and the older multi-query or
multi-head ones (parallel or sequential attention/MLP), rotary or ALiBi as the config asks."""

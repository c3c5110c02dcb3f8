"""The demo model: a small Llama trained on CPU on prose that ships with Python, so `make demo` prints readable text.

`corpus` gathers the text, `tokenizer` builds an offline byte-level tokenizer, `train` trains and saves the
checkpoint and its draft model (deterministic, seeded), `checkpoint` locates the committed copies under `assets/` or
rebuilds them.
`topics` + `finetune`: the fine-tuning demo (`make finetune-demo`): prompt-tuning it through a swarm to classify
generated sentences by topic.
"""

"""Constrained decoding: what a request's output must match (`spec`), the grammars compiled
for the tokenizer, and the per-request matchers that mask each step's logits."""

"""The served comparison's prompts: user messages of a given token length, and the token ids a
server sees for them once the chat template is applied (what the offline engine gets).

Each message is seeded random text: token ids drawn from the ordinary part of the vocabulary,
decoded, then cut so that it encodes to ``num_tokens`` tokens (a decode/encode round trip may
merge tokens; the cut is checked). Distinct seeds give distinct prompts, so no prefix is shared.
"""

from __future__ import annotations

import random
from typing import List


def user_messages(tokenizer, num_prompts: int, num_tokens: int, seed: int = 0) -> List[str]:
    """``num_prompts`` messages of about ``num_tokens`` tokens each (exactly, where the round
    trip allows)."""
    if num_prompts < 1 or num_tokens < 1:
        raise ValueError(f"need at least one prompt of one token, got {num_prompts} prompts of "
                         f"{num_tokens} tokens")
    special = set(tokenizer.all_special_ids)
    # The first 1,000 ids of a BPE vocabulary are mostly bytes and short merges; skip them.
    low, high = min(1000, len(tokenizer) // 4), len(tokenizer) - 1
    messages = []
    for p in range(num_prompts):
        rng = random.Random(seed * 1_000_003 + p)
        ids = [i for i in (rng.randint(low, high) for _ in range(num_tokens * 2))
               if i not in special]
        text = tokenizer.decode(ids[:num_tokens])
        ids = tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
        messages.append(tokenizer.decode(ids))
    return messages


def chat_token_ids(tokenizer, messages: List[str]) -> List[List[int]]:
    """Each message as the server tokenizes a one-message chat (``cluster.api.prompts``: the
    template's text with its generation prompt, encoded without adding special tokens)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                           add_generation_prompt=True) for m in messages]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]

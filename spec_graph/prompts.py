"""generate()'s request arguments checked and read: prompts to token ids, stop ids to a set.

Each bad value is a ValueError that names the argument (and the prompt's index) and says what is taken.
"""
from __future__ import annotations

from typing import Sequence

from .config import check_text, is_int

MAX_STOP_IDS = 64


def _array(v, ndim: int | None = None) -> bool:
    """A tensor or numpy array (of `ndim` dimensions, where given)."""
    return hasattr(v, "tolist") and isinstance(getattr(v, "ndim", None), int) and ndim in (None, v.ndim)


def check_max_new_tokens(max_new_tokens) -> int:
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    return int(max_new_tokens)


def prompt_ids(prompts, tokenizer, vocab_size: int) -> list[list[int]]:
    """Each prompt's token ids: strings through the tokenizer; lists, 1-D tensors or arrays of ids as they are (a
    2-D tensor or array: one prompt a row)."""
    if _array(prompts, 2):
        prompts = prompts.tolist()
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise ValueError("prompts must be a list of strings or a list of token-id lists (a list of 1-D tensors "
                         "or arrays of ids, or one 2-D tensor of them, is taken too)")
    if not prompts:
        raise ValueError("prompts is empty: pass at least one prompt")
    out = []
    for i, p in enumerate(prompts):
        if _array(p, 1):
            p = p.tolist()
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("the target checkpoint has no tokenizer.json: pass prompts as token-id lists "
                                 "(--prompt-ids on the command line)")
            check_text(p, f"prompt {i}")
            ids = tokenizer.encode(p).ids
        elif isinstance(p, Sequence) and not isinstance(p, bytes) and _all_ints(p):
            ids = [int(t) for t in p]
        else:
            raise ValueError(f"prompt {i} is neither a string nor a list (or 1-D tensor) of integer token ids"
                             + (f": it has {p.ndim} dimensions" if _array(p) else "")
                             + ("; for one prompt of token ids pass a list of it, [[1, 2, 3]]" if is_int(p) else ""))
        if not ids:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            raise ValueError(f"prompt {i} has token ids out of range [0, {vocab_size}): {bad[:5]}")
        out.append(ids)
    return out


def _all_ints(p) -> bool:
    # plain ints first: is_int's check against numbers.Integral costs about 1 us an id (a ms per call of a batch)
    return all(type(t) is int for t in p) or all(is_int(t) for t in p)


def stop_ids(stop_token_ids, eos_token_ids, vocab_size: int) -> set[int]:
    """The ids that end a request: the checkpoint's EOS ids and those given."""
    if stop_token_ids is None:
        given = []
    elif _array(stop_token_ids, 1):
        given = stop_token_ids.tolist()
    elif isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, set, frozenset)):
        raise ValueError(f"stop_token_ids must be a list of token ids or None, got {stop_token_ids!r}"
                         + (f": write [{stop_token_ids}]" if is_int(stop_token_ids) else ""))
    else:
        given = list(stop_token_ids)
    for t in given:
        if not is_int(t):
            raise ValueError(f"stop token id {t!r} (stop_token_ids) is not an integer: pass token ids, such as "
                             f"[2, 13]")
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token id {t!r} (stop_token_ids) is out of range [0, {vocab_size})")
    stop_set = set(eos_token_ids) | {int(t) for t in given}
    if len(stop_set) > MAX_STOP_IDS:
        raise ValueError(f"{len(stop_set)} stop token ids in all, the model's {len(set(eos_token_ids))} EOS ids "
                         f"counted; at most {MAX_STOP_IDS} are supported, so give at most "
                         f"{max(MAX_STOP_IDS - len(set(eos_token_ids)), 0)} stop ids besides them")
    return stop_set

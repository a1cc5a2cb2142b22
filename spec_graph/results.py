"""What ``generate`` returns: one result per prompt, and the call's stats."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or a stop id, included in token_ids), "length" or "error"
    prompt_token_ids: list[int] = field(default_factory=list)
    # drafts the target accepted at each of its steps (of the last step, a cut by max_new_tokens or a stop token
    # may commit fewer)
    accepted_counts: list[int] = field(default_factory=list)
    k_per_step: list[int] = field(default_factory=list)  # drafts proposed (K) at each of its steps


@dataclass
class GenerationStats:
    """What one ``generate`` call did.

    A *request-step* is one request's share of a forward that commits its tokens: its prefill (which
    commits its first token) and each speculative step it took part in. ``tokens_per_step`` is committed
    tokens per request-step, so that it adds up::

        tokens_per_step * request_steps == generated_tokens

    (for a single prompt and ``steps_per_graph`` 1, ``request_steps == steps + 1``). The last step of a request
    counts only the tokens it committed (``max_new_tokens`` or a stop token may cut it short); a request whose
    logits turned non-finite counts the tokens it kept.
    """

    acceptance_rate: float  # accepted / proposed draft tokens
    acceptance_rate_per_position: list[float]  # P(draft position j accepted), over the steps that proposed it
    tokens_per_step: float  # generated_tokens / request_steps (see above)
    steps: int  # speculative steps run (each is one target forward over the batch)
    prefills: int  # prefill forwards run
    generated_tokens: int
    wall_time_s: float
    request_steps: int = 0  # per request: 1 (its prefill) + the speculative steps it took part in
    k_per_step: list[int] = field(default_factory=list)  # K of each step (num_speculative_tokens="auto" varies it)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class GenerationOutput(list):
    """A list of GenerationResult, one per prompt, with ``.stats`` beside it."""

    def __init__(self, results: list[GenerationResult], stats: GenerationStats):
        super().__init__(results)
        self.stats = stats

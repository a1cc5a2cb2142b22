"""When queued requests enter free slots.

A prefill forward costs about as much for one row as for several (short prompts are bound by kernel launches), while
a free slot beside busy ones costs only its share of each step. So a freed slot may wait for others to free and
share their prefill: until the free slots have idled ``admission_wait`` slot-steps in all since the last
admission (one slot that many steps, four slots a quarter of them; a replay of N steps adds N per free slot), the
ski-rental rule. Nothing waits where no row is busy, or where every queued request already has a slot. The rule
counts steps, not time, so a seed gives the same admissions on every run (and, under "auto", the same Ks on every
call of one engine, whose step times are measured once).

An admission's prefill pads its prompts to the longest. Where that pads many positions (one long prompt beside
short ones), the admission runs as several prefill forwards of prompts of like length (``prefill_groups``).
"""
from __future__ import annotations


def admits_now(free: int, pending: int, busy: int, idle: int, wait: int) -> bool:
    """Whether the queued requests enter the free slots now, in one prefill.

    free: slots with no request; pending: requests queued; busy: slots decoding; idle: slot-steps the free
    slots have spent with requests queued since the last admission; wait: ``SpecGraphConfig.admission_wait``."""
    if not free or not pending:
        return False
    return busy == 0 or free >= pending or idle >= wait


# Padded positions a prefill forward may add (beyond its prompts' own) before its prompts split by length: below
# this a forward is bound by its kernel launches more than by its positions, and another forward costs more.
PAD_SLACK = 4096
# Past PAD_SLACK, a forward pads at most this share of its prompts' own positions.
PAD_SHARE = 0.25
# Positions of one prefill forward (rows x their padded length), past which its prompts split: its activations
# grow with them (one prompt alone runs whatever its length).
PREFILL_MAX_POSITIONS = 65536


def prefill_groups(lens: list[int]) -> list[list[int]]:
    """The indices of prompts of lengths ``lens``, grouped into prefill forwards: longest first, a prompt joining
    the forward before it while that forward's padded positions (rows x its longest) stay within PAD_SLACK of its
    prompts' own or within PAD_SHARE of them, and within PREFILL_MAX_POSITIONS."""
    groups: list[list[int]] = []
    longest = own = 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        n = lens[i]
        if groups:
            padded = (len(groups[-1]) + 1) * longest
            if padded <= PREFILL_MAX_POSITIONS and padded - own - n <= max(PAD_SLACK, PAD_SHARE * (own + n)):
                groups[-1].append(i)
                own += n
                continue
        groups.append([i])
        longest = own = n
    return [sorted(g) for g in groups]  # each forward's rows in admission order

"""When queued requests enter free slots.

A prefill forward costs about as much for one row as for several (short prompts are bound by kernel launches), while
a free slot beside busy ones costs only its share of each step. So a freed slot may wait for others to free and
share their prefill: until the free slots have idled ``admission_wait`` slot-steps in all since the last
admission (one slot that many steps, four slots a quarter of them; a replay of N steps adds N per free slot), the
ski-rental rule. Nothing waits where no row is busy, or where every queued request already has a slot. The rule
counts steps, not time, so a seed gives the same admissions on every run (and, under "auto", the same Ks on every
call of one engine, whose step times are measured once).
"""
from __future__ import annotations


def admits_now(free: int, pending: int, busy: int, idle: int, wait: int) -> bool:
    """Whether the queued requests enter the free slots now, in one prefill.

    free: slots with no request; pending: requests queued; busy: slots decoding; idle: slot-steps the free
    slots have spent with requests queued since the last admission; wait: ``SpecGraphConfig.admission_wait``."""
    if not free or not pending:
        return False
    return busy == 0 or free >= pending or idle >= wait

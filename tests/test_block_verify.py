"""Block verification: the kernel against its torch reference (Triton interpreter, fresh process), the
paper's worked example, never fewer accepted drafts than token verification, and losslessness of the
reference against exact joint laws, with broken variants that the same checks reject."""
import importlib
import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from spec_graph.kernels import block_verify_ref, race_sample, rejection_sample_ref

bv = importlib.import_module("spec_graph.kernels.block_verify")  # the package re-exports a function by this name

ROOT = Path(__file__).resolve().parents[1]


def _context_free_inputs(p, q, K, n, seed=0):
    """n rows of K drafts sampled from q (the same distributions at every position), each row its own request."""
    V = p.shape[0]
    rows = torch.arange(n)
    seeds, steps = seed * 1_000_003 + rows, torch.full((n,), 3)
    draft = torch.stack([race_sample(q.expand(n, V), seeds, steps, rows, 100 + j) for j in range(K)], 1)
    return (draft, q.expand(n, K, V).contiguous(), p.expand(n, K + 1, V).contiguous(), seeds, steps,
            torch.ones(n, dtype=torch.bool))


def test_papers_example_accepts_eleven_ninths():
    """Binary vocabulary, target (1/3, 2/3), draft (2/3, 1/3), two drafts: token verification accepts 10/9
    drafts per step, block verification 11/9 (Sun et al., section 1)."""
    p, q = torch.tensor([1 / 3, 2 / 3]), torch.tensor([2 / 3, 1 / 3])
    args = _context_free_inputs(p, q, 2, 200_000)
    block = block_verify_ref(*args)[1].double().mean().item()
    token = rejection_sample_ref(*args)[1].double().mean().item()
    assert abs(token - 10 / 9) < 0.01 and abs(block - 11 / 9) < 0.01, (token, block)


def _exact_law(p_fn, q_fn, V, K, n_out, verify):
    """The exact law of the first n_out tokens out of one verification step followed by target sampling, for
    context-dependent p_fn(prefix) / q_fn(prefix) -> [V], computed by enumerating drafts and the h_i thresholds
    of `verify` (a function like bv.block_weights returning (w, h) on one row)."""
    law = {}
    for drafts in itertools.product(range(V), repeat=K):
        pre = [tuple(drafts[:i]) for i in range(K + 1)]
        pq = np.prod([q_fn(pre[i])[drafts[i]] for i in range(K)])
        if pq == 0:
            continue
        P = torch.stack([torch.tensor(p_fn(x), dtype=torch.float64) for x in pre])[None]
        Q = torch.stack([torch.tensor(q_fn(x), dtype=torch.float64) for x in pre[:K]])[None]
        w, h = verify(torch.tensor([drafts]), Q, P, torch.ones(1, dtype=torch.bool))
        w, h = w[0].tolist(), h[0].tolist()
        for tau in range(K + 1):
            pr = (h[tau - 1] if tau else 1.0) * np.prod([1 - h[j - 1] for j in range(tau + 1, K + 1)])
            if tau == K:
                nxt = np.array(p_fn(pre[K]))
            else:
                r = np.maximum(w[tau] * np.array(p_fn(pre[tau])) - np.array(q_fn(pre[tau])), 0)
                nxt = r / r.sum() if r.sum() > 0 else np.array(p_fn(pre[tau]))
            for y in range(V):
                seq = drafts[:tau] + (y,)
                # later tokens come from the target itself
                for rest in itertools.product(range(V), repeat=max(0, n_out - len(seq))):
                    full = (seq + rest)[:n_out]
                    pr_rest = np.prod([p_fn(full[:len(seq) + k])[rest[k]] for k in range(len(rest))]) if rest else 1
                    law[full] = law.get(full, 0.0) + pq * pr * nxt[y] * pr_rest
    return law


def _target_law(p_fn, V, n_out):
    return {s: np.prod([p_fn(s[:i])[s[i]] for i in range(n_out)]) for s in itertools.product(range(V), repeat=n_out)}


def _table(V):
    g = torch.Generator().manual_seed(V)
    cache = {}

    def fn(prefix, which):
        key = (which, prefix)
        if key not in cache:
            cache[key] = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 1.5, 0).tolist()
        return cache[key]
    return lambda x: fn(x, "p"), lambda x: fn(x, "q")


def _broken_denominator(draft, Q, P, active):
    """h_i without the 1 - w_i term of its denominator (so h_i = 1 wherever s_i > 0)."""
    w, h = bv.block_weights(draft, Q, P, active)
    K = draft.shape[1]
    s = (w[:, 1:K, None] * P[:, 1:K] - Q[:, 1:K]).clamp(min=0).sum(-1)
    return w, torch.cat((torch.where(s > 0, torch.ones_like(s), h[:, :K - 1]), h[:, K - 1:]), 1)


def _unscaled_residual(draft, Q, P, active):
    """The correction drawn from max(p - q, 0) instead of max(w_tau * p - q, 0)."""
    w, h = bv.block_weights(draft, Q, P, active)
    return torch.ones_like(w), h


# Vocabularies of 4 or 5: with 2 or 3 tokens the residuals are mostly one-hot, and the broken rules hide.
@pytest.mark.parametrize("V, K", [(5, 2), (4, 3)])
def test_block_rule_is_exactly_lossless(V, K):
    """The exact law of the block rule's output equals the target's, with context-dependent models; broken
    rules are caught by the same comparison."""
    p_fn, q_fn = _table(V)
    n_out = K + 1
    want = _target_law(p_fn, V, n_out)
    got = _exact_law(p_fn, q_fn, V, K, n_out, bv.block_weights)
    assert max(abs(got.get(s, 0) - want[s]) for s in want) < 1e-12
    for broken in (_broken_denominator, _unscaled_residual):
        bad = _exact_law(p_fn, q_fn, V, K, n_out, broken)
        assert max(abs(bad.get(s, 0) - want[s]) for s in want) > 1e-4, broken.__name__


def test_reference_sampling_keeps_the_first_token_law():
    """The sampled reference (hash uniforms, residual race) keeps the target's law of the first token, and
    reaches every accepted count (the engine tests check whole joints)."""
    V, K, n = 3, 2, 60_000
    p_fn, q_fn = _table(V)
    # context-free draws keep the inputs one tensor: p and q at every position are those of the empty prefix
    p, q = torch.tensor(p_fn(())), torch.tensor(q_fn(()))
    args = _context_free_inputs(p.float(), q.float(), K, n, seed=7)
    sampled, tau = block_verify_ref(*args)
    first = sampled[:, 0].numpy()
    obs = np.bincount(first, minlength=V)
    exp = p.double().numpy() * n
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 0.01  # the first token is the target's
    hist = np.bincount(tau.numpy(), minlength=K + 1)
    assert (hist > 0).all()


def test_never_fewer_accepted_than_token_verification():
    g = torch.Generator().manual_seed(3)
    for V in (4, 16):
        p = torch.softmax(torch.randn(V, generator=g) * 2, 0)
        q = torch.softmax(torch.randn(V, generator=g) * 2, 0)
        args = _context_free_inputs(p, q, 4, 40_000, seed=V)
        assert block_verify_ref(*args)[1].double().mean() >= rejection_sample_ref(*args)[1].double().mean() - 0.01


def test_kernel_matches_reference_in_interpreter():
    """The Triton kernel (TRITON_INTERPRET=1, fresh process) against the reference on random rows with
    inactive rows, drafts out of range, equal draft and target rows, and vocabularies across BLOCK_V chunks.
    Rows may differ only where a uniform lies within rounding of its threshold h_i."""
    code = textwrap.dedent("""
        import os, torch
        assert os.environ["TRITON_INTERPRET"] == "1"
        from spec_graph.kernels import block_verify as bv_mod
        from spec_graph.kernels.block_verify import block_verify, block_verify_ref, block_weights, _block_verify_kernel
        from spec_graph.kernels.rng import use_kernel, hash_uniform, ACCEPT_COL, REQUEST_ROW
        assert use_kernel(_block_verify_kernel, torch.zeros(1))
        g = torch.Generator().manual_seed(0)
        checked = near = 0
        for B, K, V in [(7, 1, 5), (9, 3, 11), (6, 4, 1500), (5, 2, 2)]:
            logits_p = torch.randn(B, K + 1, V, generator=g) * 2
            logits_q = logits_p[:, :K] + torch.randn(B, K, V, generator=g) * 0.7
            P, Q = logits_p.softmax(-1), logits_q.softmax(-1)
            Q[0] = P[0, :K]  # a draft equal to the target
            draft = torch.stack([torch.multinomial(Q[:, j], 1, generator=g)[:, 0] for j in range(K)], 1)
            draft[1, 0] = V + 3  # out of range
            active = torch.rand(B, generator=g) > 0.2
            seeds = torch.randint(0, 2**62, (B,), generator=g)
            steps = torch.randint(0, 50, (B,), generator=g)
            got = block_verify(draft, Q, P, seeds, steps, active, max_programs=3)
            ref = block_verify_ref(draft, Q, P, seeds, steps, active)
            _, h = block_weights(draft, Q, P, active)
            u = hash_uniform(seeds[:, None], steps[:, None], REQUEST_ROW, torch.arange(K)[None], ACCEPT_COL)
            for b in range(B):
                same = torch.equal(got[0][b], ref[0][b]) and torch.equal(got[1][b], ref[1][b])
                if not same:
                    assert (u[b] - h[b]).abs().min() < 1e-5, (B, K, V, b, got[0][b], ref[0][b])
                    near += 1
                checked += 1
            assert (got[0][~active] == -1).all() and (got[1][~active] == 0).all()
        assert near <= 1, near
        print("OK", checked)
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]

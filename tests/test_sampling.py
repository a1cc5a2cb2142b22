"""Lossless sampling, tested on the joint law of generated tokens with a chi-square test.

* A near draft (a perturbed copy of the target) accepts often, so every path is sampled: a rejection at
  each draft position, and all K drafts accepted plus the bonus token. The joint of the first K+2 tokens
  (the prefill's token, then K+1 from the steps) reaches every draft position and the bonus token; the
  histogram of accepted counts is asserted to cover 0..K. Run at K=1 and K=2, eager, N-step replay and
  the compiled step.
* A far draft (TV >= 0.3 from the target) makes the residual distribution matter at position 0.
* The same tests reject deliberately broken samplers: always accepting at position 0 or at positions 1..,
  resampling from p instead of the residual, and drawing the bonus token from the wrong position.
"""
import itertools

import numpy as np
import pytest
import torch
from helpers import fake_platform, make_checkpoint, perturbed_copy
from scipy.stats import chisquare

import spec_graph.step as step_mod
from spec_graph import SpecDecoder, SpecGraphConfig, platform
from spec_graph.adaptive import KChooser
from spec_graph.kernels import PLACEHOLDER, race_sample, rejection_sample_ref
from spec_graph.sampling import SCAN_BLOCK, cumsum_last, logits_to_probs

V = 6
PROMPT = [1, 4, 2]
N = 12000
P_OK = 0.01
NEAR_NOISE = 0.1  # per-position acceptance about 0.6: rejections and full acceptance both common


def _filtered(logits, temperature, top_k, top_p):
    """Independent filter: temperature, then top-k, then top-p on the sorted distribution."""
    x = logits.double() / temperature
    order = torch.argsort(x, descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    k = top_k or len(x)
    probs = torch.softmax(x[order[:k]], 0)
    mass = 0.0
    for i, tok in enumerate(order[:k].tolist()):
        if mass >= top_p and i > 0:
            break
        keep[tok] = True
        mass += probs[i].item()
    return torch.softmax(x.masked_fill(~keep, float("-inf")), 0)


def _joint(path, n_tokens, temperature=1.0, top_k=0, top_p=1.0):
    """HF's own law of the first `n_tokens` generated tokens: a V**n_tokens table."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    joint = np.ones(())
    with torch.no_grad():
        for n in range(n_tokens):
            prefixes = list(itertools.product(range(V), repeat=n))
            logits = m(torch.tensor([PROMPT + list(p) for p in prefixes])).logits[:, -1]
            cond = torch.stack([_filtered(r, temperature, top_k, top_p) for r in logits]).numpy()
            joint = joint.reshape(-1, 1) * cond  # [V**n, V]
    return joint.reshape((V,) * n_tokens)


def _next_token_law(path):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.softmax(m(torch.tensor([PROMPT + [t] for t in range(V)])).logits[:, -1].double(), -1)


def _ckpt_kw():
    return dict(vocab_size=V, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64, eos_token_id=None)


@pytest.fixture(scope="module")
def far_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("far")
    target = make_checkpoint(root / "t", seed=3, init_std=0.5, **_ckpt_kw())
    draft = make_checkpoint(root / "d", seed=11, init_std=0.5, **_ckpt_kw())
    return target, draft


@pytest.fixture(scope="module")
def near_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("near")
    target = make_checkpoint(root / "t", seed=3, init_std=0.5, **_ckpt_kw())
    return target, perturbed_copy(target, root / "d", noise=NEAR_NOISE)


def _decoder(target, draft, K, **cfg):
    cfg = dict(num_speculative_tokens=K, max_batch_size=512, max_len=16, batch_buckets=(512,), **cfg)
    return SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(**cfg))


def _counts(dec, n_tokens, **sampling):
    """Histogram of the first `n_tokens` generated tokens over N requests, and of accepted counts per step."""
    out = dec.generate([PROMPT] * N, max_new_tokens=n_tokens, seed=1234, **sampling)
    counts = np.zeros((V,) * n_tokens)
    for r in out:
        counts[tuple(r.token_ids)] += 1
    accepted = np.bincount([a for r in out for a in r.accepted_counts], minlength=dec.K + 1)
    return counts, accepted


def _pvalue(counts, joint):
    exp = joint.ravel() * counts.sum()
    obs = counts.ravel()
    big = exp >= 5  # merge the sparse cells into one
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


# --------------------------------------------------------------- broken samplers
def _always_accept(draft_ids, draft_probs, target_probs, seeds, steps, active):
    B, K = draft_ids.shape
    rows = torch.arange(B, device=draft_ids.device)
    bonus = race_sample(target_probs[:, K], seeds, steps, rows, K)
    sampled = torch.cat((draft_ids, bonus[:, None]), 1)
    return torch.where(active[:, None], sampled, PLACEHOLDER), torch.full((B,), K, device=draft_ids.device)


def _resample_from_p(draft_ids, draft_probs, target_probs, seeds, steps, active):
    """Correct acceptance test, but a rejected position is resampled from p, not norm(max(0, p - q))."""
    sampled, n = rejection_sample_ref(draft_ids, draft_probs, target_probs, seeds, steps, active)
    B, K1 = sampled.shape
    rows = torch.arange(B, device=draft_ids.device)
    fix = torch.stack([race_sample(target_probs[:, j], seeds, steps, rows, j) for j in range(K1)], 1)
    at_n = torch.arange(K1, device=n.device)[None] == n[:, None]
    rejected = (n < K1 - 1)[:, None] & at_n
    return torch.where(rejected, fix, sampled), n


def _always_accept_after_first(draft_ids, draft_probs, target_probs, seeds, steps, active):
    """Correct at draft position 0; once it is accepted, every later draft is accepted too."""
    sampled, n = rejection_sample_ref(draft_ids, draft_probs, target_probs, seeds, steps, active)
    all_in, _ = _always_accept(draft_ids, draft_probs, target_probs, seeds, steps, active)
    later = (n >= 1)[:, None]
    return torch.where(later, all_in, sampled), torch.where(n >= 1, draft_ids.shape[1], n)


def _bonus_from_wrong_position(draft_ids, draft_probs, target_probs, seeds, steps, active):
    """Correct except that the bonus token (all K drafts accepted) is drawn from p at position K-1."""
    B, K = draft_ids.shape
    sampled, n = rejection_sample_ref(draft_ids, draft_probs, target_probs, seeds, steps, active)
    rows = torch.arange(B, device=draft_ids.device)
    wrong = race_sample(target_probs[:, K - 1], seeds, steps, rows, K)
    bonus = torch.where((n == K) & active, wrong, sampled[:, K])
    return torch.cat((sampled[:, :K], bonus[:, None]), 1), n


# ----------------------------------------------------------------------- tests
def test_pairs_are_far_and_near(far_pair, near_pair):
    p = _next_token_law(far_pair[0])
    tv_far = 0.5 * (p - _next_token_law(far_pair[1])).abs().sum(-1)
    tv_near = 0.5 * (p - _next_token_law(near_pair[1])).abs().sum(-1)
    assert tv_far.mean() >= 0.3
    assert 0.2 <= 1 - tv_near.mean() <= 0.85  # the near draft is accepted often, and rejected often


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_far_draft_joint_of_two_tokens_equals_target(far_pair, sampling):
    counts, _ = _counts(_decoder(*far_pair, K=2), 2, **sampling)
    assert _pvalue(counts, _joint(far_pair[0], 2, **sampling)) > P_OK


@pytest.mark.parametrize("broken", [_always_accept, _resample_from_p])
def test_far_draft_rejects_broken_samplers(far_pair, monkeypatch, broken):
    monkeypatch.setattr(step_mod, "rejection_sample", broken)
    counts, _ = _counts(_decoder(*far_pair, K=2), 2, temperature=1.0)
    assert _pvalue(counts, _joint(far_pair[0], 2)) < P_OK


@pytest.fixture(scope="module")
def near_joints(near_pair):
    return {n: _joint(near_pair[0], n) for n in (3, 4)}


def _check_near(dec, near_joints, **sampling):
    """Joint of the first K+2 tokens equals the target's; every accepted count 0..K was sampled."""
    K = dec.K
    counts, accepted = _counts(dec, K + 2, temperature=1.0, **sampling)
    return _pvalue(counts, near_joints[K + 2]), accepted


def _every_path(accepted) -> bool:
    """A rejection at each draft position and the all-accepted (bonus) path were each sampled often."""
    return bool((accepted > 0.02 * accepted.sum()).all())


@pytest.mark.parametrize("K", [1, 2])
def test_near_draft_joint_reaches_every_position_and_bonus(near_pair, near_joints, K):
    p, accepted = _check_near(_decoder(*near_pair, K), near_joints)
    assert _every_path(accepted), accepted
    assert p > P_OK


@pytest.mark.parametrize("K, broken", [(1, _bonus_from_wrong_position), (2, _bonus_from_wrong_position),
                                       (2, _always_accept_after_first)])
def test_near_draft_rejects_broken_samplers(near_pair, near_joints, monkeypatch, K, broken):
    monkeypatch.setattr(step_mod, "rejection_sample", broken)
    assert _check_near(_decoder(*near_pair, K), near_joints)[0] < P_OK


def _multi_step(near_pair, K, n):
    dec = _decoder(*near_pair, K, steps_per_graph=n)
    return SpecDecoder(dec.target, dec.draft, dec.config, dec.tokenizer, dec.eos_token_ids, plat=fake_platform())


@pytest.mark.parametrize("broken", [None, _bonus_from_wrong_position])
def test_near_draft_multi_step_replay(near_pair, near_joints, monkeypatch, broken):
    """N=3 steps per replay (the recorded eager step through the platform seam): same law, same controls."""
    if broken is not None:
        monkeypatch.setattr(step_mod, "rejection_sample", broken)
    dec = _multi_step(near_pair, 2, 3)
    dec.compiled = False
    p, accepted = _check_near(dec, near_joints)
    assert dec.graphs.graphs
    if broken is None:
        assert _every_path(accepted) and p > P_OK
    else:
        assert p < P_OK


def test_near_draft_compiled_step(near_pair, near_joints):
    """The step compiled by the spec_graph backend (CPU: inductor, fused prepare_next)."""
    dec = _decoder(*near_pair, 2, enable_graph=True)
    assert dec.compiled
    p, accepted = _check_near(dec, near_joints)
    assert _every_path(accepted) and p > P_OK


def _block_always_accept_first(draft_ids, draft_probs, target_probs, seeds, steps, active):
    """Block verification that keeps at least the first draft of every active row (h_1 forced to 1)."""
    sampled, tau = step_mod.kernels.block_verify_ref(draft_ids, draft_probs, target_probs, seeds, steps, active)
    if draft_ids.shape[1] < 2:
        return sampled, tau
    forced = active & (tau == 0)
    redo, n_redo = step_mod.kernels.block_verify_ref(draft_ids[:, 1:], draft_probs[:, 1:], target_probs[:, 1:],
                                                     seeds, steps, forced)
    shifted = torch.cat((draft_ids[:, :1], redo), 1)
    return torch.where(forced[:, None], shifted, sampled), torch.where(forced, n_redo + 1, tau)


@pytest.mark.parametrize("broken", [None, _block_always_accept_first, _bonus_from_wrong_position])
def test_near_draft_block_verification(near_pair, near_joints, monkeypatch, broken):
    """SpecGraphConfig(verification="block"): the joint of the first K+2 tokens is the target's, every path is
    sampled, and it accepts at least as many drafts per step as token verification on the same pair; broken
    rules are rejected by the same test."""
    if broken is not None:
        monkeypatch.setattr(step_mod, "block_verify", broken)
    p, accepted = _check_near(_decoder(*near_pair, 2, verification="block"), near_joints)
    if broken is not None:
        assert p < P_OK
        return
    assert _every_path(accepted) and p > P_OK
    _, token_level = _check_near(_decoder(*near_pair, 2), near_joints)
    mean = lambda h: (h * np.arange(len(h))).sum() / h.sum()  # noqa: E731
    assert mean(accepted) >= mean(token_level) - 0.01, (accepted, token_level)


class _ParityChooser(KChooser):
    """K from the acceptance sampled so far (1 + its parity): a choice that depends on the random past, the way
    "auto"'s does, switching often."""

    def choose(self, times, remaining=None, queued=0):
        return 1 + sum(self._last) % 2


@pytest.mark.parametrize("broken", [None, _bonus_from_wrong_position])
def test_near_draft_adaptive_k(near_pair, near_joints, monkeypatch, broken):
    """num_speculative_tokens="auto": K changes between replays as a function of what was sampled; the joint of
    the first K_max+2 tokens is still the target's, every path at K=2 is sampled; broken rules are rejected."""
    import spec_graph.runtime as runtime_mod

    monkeypatch.setattr(runtime_mod, "KChooser", _ParityChooser)
    if broken is not None:
        monkeypatch.setattr(step_mod, "rejection_sample", broken)
    dec = _decoder(*near_pair, "auto", max_speculative_tokens=2)
    dec.step_times = {(False, 512, k): 1.0 for k in (1, 2)}
    out = dec.generate([PROMPT] * N, max_new_tokens=4, seed=1234, temperature=1.0)
    counts = np.zeros((V,) * 4)
    for r in out:
        counts[tuple(r.token_ids)] += 1
    p = _pvalue(counts, near_joints[4])
    if broken is not None:
        assert p < P_OK
        return
    assert set(out.stats.k_per_step) == {1, 2}
    at_k2 = np.bincount([a for r in out for a, k in zip(r.accepted_counts, r.k_per_step) if k == 2], minlength=3)
    assert _every_path(at_k2) and p > P_OK, at_k2


def test_block_verification_keeps_greedy_output(near_pair):
    kw = dict(max_new_tokens=12)
    outs = [[r.token_ids for r in _decoder(*near_pair, 3, verification=v).generate([PROMPT, [2, 5]], **kw)]
            for v in ("token", "block")]
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="verification must be one of"):
        SpecGraphConfig(verification="blocks")
    assert SpecGraphConfig(verification="BLOCK").verification == "block"  # as "AUTO" is "auto"


def test_samples_depend_on_the_request_not_its_slot(near_pair):
    """The same seed gives the same samples whatever the number of slots, the queueing order (which slot a
    request lands in) and the steps per replay: every draw is keyed by the request's own seed and steps."""
    prompts = [PROMPT, [2, 3], [5, 1, 1, 4], [0], [3, 3, 3], [4, 2]]
    kw = dict(max_new_tokens=10, temperature=1.0, top_k=5, seed=11)
    runs = []
    for slots, n in ((8, 1), (1, 1), (3, 1), (2, 3)):
        cfg = SpecGraphConfig(num_speculative_tokens=2, max_batch_size=slots, max_len=24, steps_per_graph=n)
        dec = SpecDecoder.from_pretrained(*near_pair, cfg)
        if n > 1:
            dec = SpecDecoder(dec.target, dec.draft, dec.config, dec.tokenizer, dec.eos_token_ids, plat=fake_platform())
            dec.compiled = False
        runs.append([r.token_ids for r in dec.generate(prompts, **kw)])
    assert all(r == runs[0] for r in runs[1:]), runs
    assert len({tuple(t) for t in runs[0]}) == len(prompts)


def test_logits_to_probs_matches_independent_filter():
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    temps = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.0, 1.3])
    ks = torch.tensor([0, 5, 1, 40, 7, 0])
    ps = torch.tensor([1.0, 0.8, 1.0, 0.3, 0.95, 0.5])
    got = logits_to_probs(logits, temps, ks, ps)
    for b in range(6):
        ref = _filtered(logits[b], temps[b].item(), int(ks[b]), ps[b].item()).float()
        torch.testing.assert_close(got[b], ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("V", [7, SCAN_BLOCK, SCAN_BLOCK + 1, 32000])
def test_blocked_cumsum_equals_cumsum(V):
    x = torch.rand(2, 3, V, dtype=torch.float64)
    torch.testing.assert_close(cumsum_last(x), torch.cumsum(x, -1))


def _vocab_32000_inputs(B, device):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(B, 5, 32000, generator=g) * 4).to(device)
    return (logits, torch.full((B,), 0.8, device=device), torch.full((B,), 50, device=device, dtype=torch.long),
            torch.full((B,), 0.9, device=device))


def test_logits_to_probs_compiled_at_vocab_32000():
    args = _vocab_32000_inputs(2, "cpu")
    torch.testing.assert_close(torch.compile(logits_to_probs, fullgraph=True)(*args), logits_to_probs(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8])
def test_logits_to_probs_compiled_on_device_at_vocab_32000(B):
    # few rows over a long vocab: the case inductor would lower to a split scan
    args = _vocab_32000_inputs(B, platform.current().device)
    got = torch.compile(logits_to_probs, fullgraph=True, dynamic=False)(*args)
    torch.testing.assert_close(got, logits_to_probs(*args))


def test_same_seed_same_output_and_seeds_differ(far_pair):
    dec = SpecDecoder.from_pretrained(*far_pair, SpecGraphConfig(num_speculative_tokens=3, max_len=32))
    a = dec.generate([PROMPT] * 4, 10, temperature=1.0, seed=5)
    b = dec.generate([PROMPT] * 4, 10, temperature=1.0, seed=5)
    c = dec.generate([PROMPT] * 4, 10, temperature=1.0, seed=6)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    assert len({tuple(r.token_ids) for r in a}) > 1  # requests draw independent streams

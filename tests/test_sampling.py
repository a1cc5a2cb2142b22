"""Lossless sampling: the joint law of the first two generated tokens equals the target's (chi-square),
and the same test rejects two broken samplers."""
import numpy as np
import pytest
import torch
from helpers import make_checkpoint
from scipy.stats import chisquare

import spec_graph.step as step_mod
from spec_graph import SpecDecoder, SpecGraphConfig, platform
from spec_graph.kernels import PLACEHOLDER, race_sample
from spec_graph.sampling import SCAN_BLOCK, cumsum_last, logits_to_probs

V = 8
PROMPT = [1, 4, 2]
N = 12000


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


def _joint(path, temperature=1.0, top_k=0, top_p=1.0):
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = _filtered(m(torch.tensor([PROMPT])).logits[0, -1], temperature, top_k, top_p)
        seqs = torch.tensor([PROMPT + [t] for t in range(V)])
        p2 = torch.stack([_filtered(r, temperature, top_k, top_p) for r in m(seqs).logits[:, -1]])
    return (p1[:, None] * p2).numpy(), p2


@pytest.fixture(scope="module")
def far_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("far")
    kw = dict(vocab_size=V, hidden_size=32, layers=1, heads=2, kv_heads=1, intermediate_size=64, eos_token_id=None)
    target = make_checkpoint(root / "t", seed=3, init_std=0.5, **kw)
    draft = make_checkpoint(root / "d", seed=11, init_std=0.5, **kw)
    return target, draft


def _counts(target, draft, K=2, **sampling):
    dec = SpecDecoder.from_pretrained(target, draft, SpecGraphConfig(num_speculative_tokens=K, max_batch_size=512,
                                                                     max_len=16, batch_buckets=(512,)))
    out = dec.generate([PROMPT] * N, max_new_tokens=2, seed=1234, **sampling)
    counts = np.zeros((V, V))
    for r in out:
        counts[r.token_ids[0], r.token_ids[1]] += 1
    return counts


def _pvalue(counts, joint):
    exp = joint.ravel() * counts.sum()
    obs = counts.ravel()
    big = exp >= 5  # merge the sparse cells into one
    obs = np.append(obs[big], obs[~big].sum())
    exp = np.append(exp[big], exp[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def test_draft_is_far_from_target(far_pair):
    _, p2 = _joint(far_pair[0])
    _, q2 = _joint(far_pair[1])
    tv = 0.5 * (p2 - q2).abs().sum(-1)
    assert tv.mean() >= 0.3


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)])
def test_sampled_joint_equals_target(far_pair, sampling):
    joint, _ = _joint(far_pair[0], **sampling)
    assert _pvalue(_counts(*far_pair, **sampling), joint) > 0.01


def _always_accept(draft_ids, draft_probs, target_probs, seeds, steps, active):
    B, K = draft_ids.shape
    rows = torch.arange(B, device=draft_ids.device)
    bonus = race_sample(target_probs[:, K], seeds, steps, rows, K)
    sampled = torch.cat((draft_ids, bonus[:, None]), 1)
    return torch.where(active[:, None], sampled, PLACEHOLDER), torch.full((B,), K, device=draft_ids.device)


def _resample_from_p(draft_ids, draft_probs, target_probs, seeds, steps, active):
    """Correct acceptance test, but a rejected position is resampled from p, not norm(max(0, p - q))."""
    from spec_graph.kernels import rejection_sample_ref

    sampled, n = rejection_sample_ref(draft_ids, draft_probs, target_probs, seeds, steps, active)
    B, K1 = sampled.shape
    rows = torch.arange(B, device=draft_ids.device)
    fix = torch.stack([race_sample(target_probs[:, j], seeds, steps, rows, j) for j in range(K1)], 1)
    at_n = torch.arange(K1, device=n.device)[None] == n[:, None]
    rejected = (n < K1 - 1)[:, None] & at_n
    return torch.where(rejected, fix, sampled), n


@pytest.mark.parametrize("broken", [_always_accept, _resample_from_p])
def test_chi_square_rejects_broken_samplers(far_pair, monkeypatch, broken):
    joint, _ = _joint(far_pair[0])
    monkeypatch.setattr(step_mod, "rejection_sample", broken)
    assert _pvalue(_counts(*far_pair, temperature=1.0), joint) < 0.01


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

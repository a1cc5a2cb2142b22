"""Acceptance of the embedded default pair on held-out standard-library prompts, through SpecDecoder.

    python examples/default_pair_acceptance.py [-k 4] [--prompts 20] [--max-new-tokens 128]

The prompts come from the files the training script held out (the same path-hash split).
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_default_pair import load_corpus, make_prompts  # noqa: E402

from spec_graph import SpecDecoder, SpecGraphConfig  # noqa: E402
from spec_graph.cli import DEFAULT_PAIR  # noqa: E402


def measure(k: int = 4, n_prompts: int = 20, max_new_tokens: int = 128, device: str | None = None, seed: int = 0):
    _, val, _ = load_corpus(Path(sysconfig.get_paths()["stdlib"]), val_every=20, max_file_bytes=400_000)
    prompts = make_prompts(val, n_prompts, seed)
    cfg = SpecGraphConfig(num_speculative_tokens=k, max_batch_size=8, max_len=512, device=device)
    dec = SpecDecoder.from_pretrained(DEFAULT_PAIR / "target", DEFAULT_PAIR / "draft", cfg)
    return dec.generate(prompts, max_new_tokens).stats


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    s = measure(a.k, a.prompts, a.max_new_tokens, a.device)
    print(json.dumps(s.to_dict(), indent=1))


if __name__ == "__main__":
    main()

"""The fleet benchmark's workloads, modelled on llm-d's guide to P2P KV
sharing: each is built from a seed and printed with its parameters, so a
run can be repeated and every arm of a run gets the same requests.

* **hot**: a pool of long shared prefixes (a system prompt, a document),
  each request one prefix, drawn with Zipf popularity, plus a short
  suffix of its own; Poisson arrivals.
* **multiturn**: chat sessions, each turn's prompt the previous turn's
  prompt and answer plus a new user message; sessions start at random in
  the window's first half and each waits an exponential think time after
  an answer.
* **uniform**: every prompt its own, nothing shared: the control, where
  p2p_kv can only cost.

A workload is a list of :class:`Stream`: what one client sends, in order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORKLOADS = ("hot", "multiturn", "uniform")

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u")


@dataclass
class Stream:
    """What one client sends: its first turn at ``start_s`` after the run
    starts, each later turn ``think_s[i]`` after the previous answer. With
    ``carry`` a turn's prompt is the previous prompt, its answer and the
    turn's text; without, the turn's text alone."""

    start_s: float
    turns: list[str]
    think_s: list[float] = field(default_factory=list)
    carry: bool = False


@dataclass
class Workload:
    name: str
    params: dict[str, Any]
    streams: list[Stream]

    def describe(self) -> str:
        kv = ", ".join(f"{k}={v}" for k, v in self.params.items())
        return f"{self.name} ({kv})"


class Texts:
    """Seeded text of about a given number of the model's tokens."""

    def __init__(self, model: str, rng: random.Random) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        self._rng = rng

    def __call__(self, tokens: int) -> str:
        rng = self._rng
        words = []
        for _ in range(tokens):  # about one word in two is one token
            n = rng.randint(1, 3)
            words.append(
                "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(n))
            )
        ids = self._tok.encode(" ".join(words), add_special_tokens=False).ids
        return str(self._tok.decode(ids[:tokens]))


def _arrivals(rng: random.Random, rate: float, seconds: float) -> list[float]:
    """Poisson arrival times in ``[0, seconds)``."""
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def hot(
    model: str,
    *,
    seed: int,
    rate: float,
    seconds: float,
    prefixes: int,
    prefix_tokens: int,
    suffix_tokens: int,
    zipf_s: float = 0.8,
) -> Workload:
    rng = random.Random(f"hot-{seed}")
    text = Texts(model, rng)
    pool = [text(prefix_tokens) for _ in range(prefixes)]
    weights = [1.0 / (i + 1) ** zipf_s for i in range(prefixes)]
    streams = [
        Stream(t, [rng.choices(pool, weights)[0] + " " + text(suffix_tokens)])
        for t in _arrivals(rng, rate, seconds)
    ]
    params = {
        "seed": seed,
        "rate_per_s": rate,
        "seconds": seconds,
        "prefixes": prefixes,
        "prefix_tokens": prefix_tokens,
        "suffix_tokens": suffix_tokens,
        "zipf_s": zipf_s,
        "requests": len(streams),
    }
    return Workload("hot", params, streams)


def multiturn(
    model: str,
    *,
    seed: int,
    rate: float,
    seconds: float,
    first_tokens: int,
    turn_tokens: int,
    turns: int,
    think_s: float = 2.0,
) -> Workload:
    """``rate * seconds / turns`` sessions (at least one), so that about
    ``rate`` requests a second arrive; each starts at a uniformly drawn
    time in the window's first half, leaving it time for its turns."""
    rng = random.Random(f"multiturn-{seed}")
    text = Texts(model, rng)
    n = max(1, round(rate * seconds / turns))
    streams = [
        Stream(
            t,
            [text(first_tokens)] + [text(turn_tokens) for _ in range(turns - 1)],
            [rng.expovariate(1.0 / think_s) for _ in range(turns - 1)],
            carry=True,
        )
        for t in sorted(rng.uniform(0, seconds / 2) for _ in range(n))
    ]
    params = {
        "seed": seed,
        "rate_per_s": rate,
        "seconds": seconds,
        "sessions": len(streams),
        "turns": turns,
        "first_tokens": first_tokens,
        "turn_tokens": turn_tokens,
        "think_s": think_s,
    }
    return Workload("multiturn", params, streams)


def uniform(
    model: str, *, seed: int, rate: float, seconds: float, tokens: int
) -> Workload:
    rng = random.Random(f"uniform-{seed}")
    text = Texts(model, rng)
    streams = [Stream(t, [text(tokens)]) for t in _arrivals(rng, rate, seconds)]
    params = {
        "seed": seed,
        "rate_per_s": rate,
        "seconds": seconds,
        "tokens": tokens,
        "requests": len(streams),
    }
    return Workload("uniform", params, streams)

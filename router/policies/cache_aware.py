"""Our policy: send each request where it costs the fleet least time to first token.

The cost of sending a request to a worker is a queueing model of its engine, in seconds:

    uncached = prompt_tokens - matched_tokens
    work     = queued_prefill_tokens + uncached
    ttft     = work / prefill_tokens_per_s + max(1, ceil(work / chunk_tokens)) * running_decode
               * decode_token_s
    cost     = ttft + externality * waiting * uncached / prefill_tokens_per_s

`ttft` is this request's own wait: the prefill routed to the worker and not yet done, plus its
own uncached tokens, in chunks of at most `chunk_tokens` per engine step; every step also
advances each running decode by a token (vLLM's chunked schedule, SGLang's mixed chunks).

The last term is what the choice costs everyone else. Uncached tokens are work that delays every
request in flight where it runs: those awaiting their first token wait for it, and decoding ones
advance one token per engine step while prefill chunks lengthen the steps (chunked prefill). In
a FIFO queue's steady state a job delays as many requests as it finds (a departing job leaves
behind as many as arrived during its stay), and with backlogs kept level the fleet shares the
delay as one pooled queue. So `waiting` is the mean, over the candidates, of requests in flight.
An idle fleet recomputes freely; a busy one keeps prefixes where they are, because recomputing
them takes capacity everyone is queueing for.

Cache and load are priced in one unit: a cached block saves `block_size / prefill_tokens_per_s`
seconds, a queued token costs as much. A hot prefix's holder with a long queue loses to an idle
worker exactly when recomputing the prefix there is cheaper (herding).

When every candidate holds the same prefix (none, on a cold miss), the rest of the prompt is new:
it goes to the rendezvous (highest-random-weight) winner of its first new block, among workers
within `max(rendezvous_slack_s, rendezvous_factor * best ttft)` of the best cost. The rendezvous
is weighted by `(mean inflow / a worker's inflow) ** inflow_power`, where inflow is the blocks a
worker's cache has stored (from KV events): new content spreads evenly over the caches, so each
keeps what it holds about as long as the others (SGLang's router gets this from its smallest
tree). Gateway replicas that see the same index agree without talking, and a burst of requests
sharing a new prefix lands together before the workers report it. Exact ties elsewhere are
broken by the same hash.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import xxhash

from router.policies.base import Candidate, Decision, RouteRequest, Score

_xxh3 = xxhash.xxh3_64_intdigest
_new = tuple.__new__  # Score(...) without NamedTuple's Python-level __new__: hot path
_U64 = (1 << 64) - 1


class CacheAwarePolicy:
    """Minimise the fleet's time to first token; rendezvous-hash what is new.

    Defaults describe an 8B model in bf16 on one H100:
      prefill_tokens_per_s = 15000  ~2*8e9 FLOP/token at ~25-40% of 989 TFLOP/s (10-20k tok/s)
      decode_token_s = 2e-4         one decoding request's share of a step (its KV read and
                                    scheduling); 64 of them make ~13 ms of a 10-30 ms step
      chunk_tokens = 8192           prefill tokens per engine step (SGLang's chunked prefill
                                    size, vLLM's max_num_batched_tokens)
      externality = 1.0             weight of the delay imposed on others: 1 is the model, 0 is
                                    selfish (own TTFT only); a switch for ablations
      rendezvous_slack_s = 0.05     new prefixes may take a worker this much slower than the
      rendezvous_factor = 0.25      best, or this fraction of the best TTFT if larger: within the
                                    estimate's own error, agreement is worth more
      inflow_power = 1.0            how hard new content is steered to the less-filled caches
                                    (1: chance inversely proportional to inflow; 0: plain hash)
    Reasons: "cache_hit" (the chosen worker holds the longest match; "cold_miss" when no one
    holds anything) or "load" (a worker holding more of the prompt lost on its queue).
    """

    name = "cache_aware"

    def __init__(
        self,
        prefill_tokens_per_s: float = 15_000.0,
        decode_token_s: float = 2e-4,
        chunk_tokens: int = 8192,
        externality: float = 1.0,
        rendezvous_slack_s: float = 0.05,
        rendezvous_factor: float = 0.25,
        inflow_power: float = 1.0,
    ) -> None:
        if prefill_tokens_per_s <= 0 or chunk_tokens <= 0:
            raise ValueError("prefill_tokens_per_s and chunk_tokens must be positive")
        if min(decode_token_s, externality, rendezvous_slack_s, rendezvous_factor) < 0:
            raise ValueError("decode_token_s, externality and rendezvous bounds must be >= 0")
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.decode_token_s = decode_token_s
        self.chunk_tokens = chunk_tokens
        self.externality = externality
        self.rendezvous_slack_s = rendezvous_slack_s
        self.rendezvous_factor = rendezvous_factor
        self.inflow_power = inflow_power
        self._s_per_token = 1.0 / prefill_tokens_per_s
        self._name_bytes: dict[str, bytes] = {}

    def ttft(self, request: RouteRequest, candidate: Candidate) -> float:
        """Estimated seconds to this request's first token on `candidate`."""
        matched = min(candidate.matched_blocks * request.block_size, request.prompt_tokens)
        work = candidate.queued_prefill_tokens + request.prompt_tokens - matched
        steps = -(-work // self.chunk_tokens) or 1
        return work * self._s_per_token + steps * candidate.running_decode * self.decode_token_s

    def cost(self, request: RouteRequest, candidate: Candidate, waiting: float) -> float:
        """What `choose` minimises (the score's cost); `waiting` as in the module docstring."""
        matched = min(candidate.matched_blocks * request.block_size, request.prompt_tokens)
        delay = self.externality * waiting * (request.prompt_tokens - matched) * self._s_per_token
        return self.ttft(request, candidate) + delay

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        block_size = request.block_size
        prompt = request.prompt_tokens
        chunk = self.chunk_tokens
        s_per_token = self._s_per_token
        decode_token_s = self.decode_token_s
        waiting = 0
        for c in candidates:
            waiting += c.in_flight
        # seconds of everyone else's delay per uncached token
        s_delay = self.externality * max(waiting, 0) / len(candidates) * s_per_token

        scores: list[Score] = []
        best, best_cost, n_best = 0, float("inf"), 0
        most_blocks = -1
        fewest_blocks = 1 << 62
        for i, c in enumerate(candidates):  # ttft and cost, inlined: this loop is the hot path
            blocks = c.matched_blocks
            matched = blocks * block_size
            if matched > prompt:
                matched = prompt
            work = c.queued_prefill_tokens + prompt - matched
            cost = (
                work * s_per_token
                + (-(-work // chunk) or 1) * c.running_decode * decode_token_s
                + (prompt - matched) * s_delay
            )
            scores.append(_new(Score, (c.worker, matched, c.in_flight, cost)))
            if cost < best_cost:
                best, best_cost, n_best = i, cost, 1
            elif cost == best_cost:
                n_best += 1
            if blocks > most_blocks:
                most_blocks = blocks
            if blocks < fewest_blocks:
                fewest_blocks = blocks

        keys = request.block_keys
        n_keys = len(keys)
        if n_keys == 0:  # no full block, nothing to hash: lowest cost, then fewest in flight
            best = min(
                range(len(scores)), key=lambda i: (scores[i].cost, scores[i].load, scores[i].worker)
            )
            return Decision(scores[best].worker, "cold_miss", tuple(scores))

        if fewest_blocks == most_blocks < n_keys:
            # Everyone holds the same prefix and the rest is new, so the delay term is the same
            # for all: bound by the best own TTFT, rendezvous on the first new block.
            new_tokens = prompt - scores[best].matched_tokens
            best_ttft = best_cost - new_tokens * s_delay
            bound = best_cost + max(self.rendezvous_slack_s, self.rendezvous_factor * best_ttft)
            best = self._rendezvous(scores, keys[most_blocks], bound, candidates)
        elif n_best > 1:  # exact tie: hash the first block the tied workers do not all hold
            tied = [i for i, s in enumerate(scores) if s.cost == best_cost]
            shared = min(candidates[i].matched_blocks for i in tied)
            best = self._rendezvous_among(scores, tied, keys[min(shared, n_keys - 1)])

        if most_blocks <= 0:
            reason = "cold_miss"
        elif candidates[best].matched_blocks >= most_blocks:
            reason = "cache_hit"
        else:
            reason = "load"
        return Decision(scores[best].worker, reason, tuple(scores))

    def _weight(self, worker: str, key: int) -> int:
        """Rendezvous weight: xxh3_64(worker name, seed=block key); same in every process."""
        raw = self._name_bytes.get(worker)
        if raw is None:
            raw = self._name_bytes[worker] = worker.encode()
        return _xxh3(raw, key & _U64)

    def _rendezvous(
        self, scores: list[Score], key: int, bound: float, candidates: Sequence[Candidate]
    ) -> int:
        """Weighted rendezvous among the workers within `bound`: a worker's chance is
        inversely proportional to its cache inflow so far, so new content spreads evenly."""
        eligible = [i for i, s in enumerate(scores) if s.cost <= bound]
        mean = sum(candidates[i].stored_blocks for i in eligible) / len(eligible) + 1.0
        best, best_score = -1, -1.0
        for i in eligible:
            u = (self._weight(scores[i].worker, key) + 1) / 18446744073709551617.0
            weight = (mean / (candidates[i].stored_blocks + 1.0)) ** self.inflow_power
            score = weight / -math.log(u)
            if score > best_score:
                best, best_score = i, score
        return best

    def _rendezvous_among(self, scores: list[Score], among: list[int], key: int) -> int:
        return max(among, key=lambda i: self._weight(scores[i].worker, key))

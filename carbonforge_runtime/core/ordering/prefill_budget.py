"""How many prompt tokens a tenant over its fair share may have computed in one engine step. Pure.

Fair admission (:mod:`.tenancy`) decides *who* is admitted next; it cannot make the engine's
steps shorter. Under a flood the flooding tenant fills the running batch, and vLLM packs every
free slot's prompt into the next step: with long prompts most steps carry hundreds to thousands
of prompt tokens, and every running request of every tenant decodes one token per such step. A
steady tenant that is admitted at once still sees its decode stretched 2-3x (issue 33: on the
twin, 136 ms per output token beside a prompt-heavy flood against 52 ms alone).

The cap. While more than one tenant has work (requests running or waiting), a tenant that holds
more than its fair part of the running batch gets at most ``fair_prefill_tokens`` prompt tokens
computed per step, summed over all its requests (chunks of requests already running, and the
first chunk of requests admitted in the step). Its fair part is its share divided by the sum of
the shares of the tenants with work, times the requests running. Decode tokens are never capped,
and a tenant at or under its part (the steady one) is not capped at all.

Why this keeps throughput: the cap spreads the flood's prompts over many steps instead of a few
large ones, so the steps that would only decode (which cost the same whether they carry 20 or 150
tokens, on a GPU as in the twin's step model) also compute a prompt chunk. Fewer of the flood's
requests run at once (its admissions are paced by its prompt tokens per step), so each step is
shorter and everybody's decode is faster. The engine does the same work; only the shape of the
steps changes. A cap far below the point where a step's cost starts to grow with its tokens
(about 150 tokens on the A100 model) would slow the flood; far above it, it changes little.

With one tenant, or with ``fair_prefill_tokens: 0``, or with ``fairness: off``, nothing is capped
and vLLM's steps are its own.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

#: The default of ``fair_prefill_tokens``: about the step size past which a step's cost grows with its tokens.
DEFAULT_FAIR_PREFILL_TOKENS = 128


def over_share(running: Mapping[str, int], shares: Mapping[str, float]) -> set[str]:
    """The tenants that hold more than their fair part of the running batch.

    ``shares`` names every tenant with work (requests running or waiting) and its share;
    ``running`` the requests each has running (a tenant absent runs none). With fewer than two
    tenants with work, nobody is over: there is no one to be fair to.
    """
    if len(shares) < 2:
        return set()
    total_share = sum(shares.values())
    total_running = sum(running.get(tenant, 0) for tenant in shares)
    if total_share <= 0 or total_running <= 0:
        return set()
    # running / total_running > share / total_share, cross-multiplied, with room for rounding so
    # that tenants exactly at their part (in exact arithmetic) are never over
    return {tenant for tenant, share in shares.items()
            if running.get(tenant, 0) * total_share > total_running * share * (1 + 1e-9)}


def prefill_budgets(running: Mapping[str, int], shares: Mapping[str, float], cap: int) -> dict[str, int]:
    """Prompt tokens each capped tenant may have computed in the coming step (tenants not named: no cap)."""
    if cap <= 0:
        return {}
    return dict.fromkeys(over_share(running, shares), cap)


def is_prefill(num_computed_tokens: int, num_tokens: int) -> bool:
    """Whether a chunk starting at ``num_computed_tokens`` of a request of ``num_tokens`` tokens
    computes prompt (or, after a preemption, recomputes known tokens) rather than decoding: vLLM's
    own test for a prefill it may defer."""
    return num_computed_tokens < num_tokens - 1


def grant(left: int, wanted: int) -> int:
    """Prompt tokens a capped tenant with ``left`` tokens of its step budget gets of the ``wanted`` ones."""
    return max(0, min(wanted, left))


def spent(budgets: Mapping[str, int]) -> Collection[str]:
    """The tenants whose budget for this step is used up: the waiting queue passes over them."""
    return {tenant for tenant, left in budgets.items() if left <= 0}

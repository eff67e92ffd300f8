"""Replay real coding-agent sessions through a fleet (issue 40).

Data flow: `bench.traces` reads the sessions -> `prompts` turns each request into text with
the trace's prefix structure (token counts scaled by a stated factor) -> `client` sends the
sessions through a fleet's entry point in closed loop and feeds the same prompts to `bound`
(an exact LRU over the pool's total cache: the best routing could do) -> a summary per fleet
(requests, errors, achieved hit rate against the bound, TTFT, goodput). `local` makes fleets
on the local stack, one per routing policy; ``python -m bench.replay`` is the command.
"""

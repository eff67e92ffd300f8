"""``make run``: the whole local stack with sample fleets and live traffic, viewed until Ctrl-C
(:mod:`~e2e.demo.run_local`). Uses every other sub-package; nothing imports it."""

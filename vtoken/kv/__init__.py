"""Below the policy boundary: block pool, token tables, reclaimer, copy engine, KV tensors."""

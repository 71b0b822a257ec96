"""The compile contract both services share: the compile config and its Inductor options allowlist, the cache key
and its factors (compiler settings, Kiln's own code hash), the piecewise split's runtime form, compile counters,
what the compile passes read of a traced graph's nodes."""

"""The gateway's result cache: what determines a result, digested into its key (digests), and where results are
kept — an in-process LRU in front of Redis (store)."""

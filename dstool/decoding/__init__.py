"""The decoding room: the prefill-and-decode loop (engine), the sampler and the request's parameters (sampling), the
structured-output grammars (grammar) and their typed errors (errors). Self-contained — numpy (and llguidance for a
grammar), nothing else of dstool — because `dstool export` copies this package whole beside the python-backend models
that run it inside Triton (as `decoding`); the gateway, batch, the edge runner, compress and the CLI import it as
`dstool.decoding`, so every one of them reads requests by the same rules and defaults."""

"""Tenants on the gateway (`--auth keys`): their keys as Redis keeps them (auth), who a request comes from and what
its limits admit (guard), and the fair share of generating sequences between tenants (fairness)."""

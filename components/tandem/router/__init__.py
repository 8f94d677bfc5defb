"""Router: worker registry, liveness, load accounting and routing policy (frontend side)."""

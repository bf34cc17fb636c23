"""Dashboard pages: each module has ``layout(ctx, run, query)`` and ``register(app, ctx)``."""

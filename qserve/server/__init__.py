"""The OpenAI-compatible server: `build_app(engine, ServerConfig(...))` or `qserve serve`."""
